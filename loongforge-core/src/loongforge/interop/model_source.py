"""A model to build and fill from either checkpoint kind, for the commands that read one model outside training
(``generate``, ``diff``, ``eval``).

A directory with ``config.json`` and no ``manifest.json`` (or a Hugging Face Hub id, :mod:`loongforge.hf_dirs`) is
read as a Hugging Face checkpoint (its family's reader and adapter), anything else as a LoongForge checkpoint (a step
directory, a checkpoint root with ``latest``, or a converted one; a LoRA run's adapters are folded in). The caller
builds the model through the family's ``build_chunk`` (the one builder) and hands it to :attr:`ModelSource.load`, so
what it computes is what a converted or trained model computes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.checkpoint.manifest import MANIFEST
from loongforge.errors import InteropError
from loongforge.models.hf_format import CONFIG_JSON


@dataclass(frozen=True)
class ModelSource:
    """What a checkpoint holds: its model family, the dtype of its weights, ``load(model) -> model`` (fills a model
    built from ``family``), the tokenizer it carries (``tokenizer()``: a spec, or ``None``), whether it is a Hugging
    Face directory, and for a LoongForge checkpoint its config (``None`` for a Hugging Face directory)."""

    path: Path
    family: Any
    dtype: str
    load: Callable[[Any], Any]
    tokenizer: Callable[[], str | None]
    is_hf: bool
    config: Any = None


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face checkpoint: ``config.json`` and no LoongForge manifest."""
    return (path / CONFIG_JSON).is_file() and not (path / MANIFEST).is_file()


def open_model_source(path: str | Path, *, trust_code: bool = False, command: str = "this command") -> ModelSource:
    """The model ``path`` holds; a model that is not a megatron language or vision-language model (a task engine's)
    is one line naming ``command``, which reads megatron models only."""
    from loongforge.hf_dirs import resolve_hub_directory

    path = resolve_hub_directory(str(path))  # a Hugging Face Hub id: its snapshot in the local cache
    return _open_hf(path) if is_hf_directory(path) else _open_checkpoint(path, trust_code, command)


def _open_hf(path: Path) -> ModelSource:
    from loongforge.checkpoint.carried_tokenizer import carried_tokenizer
    from loongforge.interop.hf_checkpoint import check_hf_tensors, index_hf_tensors, load_hf_tensors
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.hf_format import read_hf_model

    family = read_hf_model(path).family
    infos = index_hf_tensors(path)
    dtype = check_hf_tensors(infos, family, path)

    def load(model: Any) -> Any:
        load_full_state([model], family.hf_adapter().from_hf(load_hf_tensors(infos)))
        return model

    return ModelSource(path, family, dtype, load, lambda: carried_tokenizer(path), is_hf=True)


def _open_checkpoint(path: Path, trust_code: bool, command: str) -> ModelSource:
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        checkpoint_config,
        checkpoint_dtype,
        checkpoint_tokenizer,
        load_trained_model,
        resolve_family,
    )
    from loongforge.resolve import model_label

    path = find_checkpoint(path)
    config = checkpoint_config(path, trust_code=trust_code)
    family = resolve_family(config)
    if family.engine != "megatron":
        raise InteropError(f"{path}: model '{model_label(config, family)}' is trained by the {family.engine!r} engine; "
                           f"{command} reads megatron language and vision-language models")
    return ModelSource(path, family, checkpoint_dtype(path, config), lambda m: load_trained_model(path, m, config),
                       lambda: checkpoint_tokenizer(path, config), is_hf=False, config=config)
