"""``loongforge generate``: a quick look at what a checkpoint writes, from either checkpoint kind.

A directory with ``config.json`` and no ``manifest.json`` is read as a Hugging Face checkpoint, anything
else as a LoongForge checkpoint (a step directory, a checkpoint root with ``latest``, or a converted one).
The model is built at TP=PP=1 on CPU through its family's ``build_chunk`` (the one builder,
:mod:`loongforge.models.building`) and filled by the same loaders conversion uses, so what this prints is what
a converted or trained model computes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loongforge.checkpoint.manifest import MANIFEST
from loongforge.errors import InteropError
from loongforge.models.hf_config import CONFIG_JSON


def _open_hf(path: Path) -> tuple[Any, str, Callable[[Any], Any], str | None]:
    from loongforge.interop.hf_checkpoint import check_hf_tensors, index_hf_tensors, load_hf_tensors
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.hf_config import read_hf_config

    flavor = read_hf_config(path).flavor
    infos = index_hf_tensors(path)
    dtype = check_hf_tensors(infos, flavor, path)

    def load(model: Any) -> Any:
        load_full_state([model], flavor.hf_adapter().from_hf(load_hf_tensors(infos)))
        return model

    return flavor, dtype, load, f"hf:{path}" if (path / "tokenizer.json").is_file() else None


def _open_checkpoint(path: Path, trust_code: bool) -> tuple[Any, str, Callable[[Any], Any], str | None]:
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        HF_SOURCE,
        checkpoint_config,
        checkpoint_dtype,
        load_trained_model,
        resolve_flavor,
    )
    from loongforge.resolve import model_label

    path = find_checkpoint(path)
    config = checkpoint_config(path, trust_code=trust_code)
    own = path / HF_SOURCE
    tokenizer = f"hf:{own}" if (own / "tokenizer.json").is_file() else config.data.tokenizer
    family = resolve_flavor(config)
    if family.engine != "megatron":
        raise InteropError(f"{path}: model '{model_label(config, family)}' is trained by the {family.engine!r} engine; "
                           "`loongforge generate` writes text with megatron language models")
    return family, checkpoint_dtype(path, config), lambda m: load_trained_model(path, m, config), tokenizer


def _tokenizer(spec: str) -> Any:
    """``spec`` as a run names it: a registered tokenizer kind (``byte``, a plugin's ``byte-vision``) with an
    optional ``:argument``, else a directory holding ``tokenizer.json``."""
    from loongforge.data.tokenizers import load_tokenizer
    from loongforge.plugins import get_host

    kind, _, argument = spec.partition(":")
    registry = get_host().registry("tokenizer")
    if kind not in registry:
        return load_tokenizer(spec)
    factory = registry.load(kind, where="the tokenizer")
    return factory(argument) if argument else factory()


def generate_from_checkpoint(
    path: str | Path,
    prompt: str,
    *,
    tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: str | None = None,
    trust_code: bool = False,
) -> str:
    """``prompt`` and its continuation by the model in ``path`` (greedy unless ``temperature > 0``); ``trust_code``
    lets a ``pkg.module:attr`` model name in a LoongForge checkpoint's config import its module."""
    from loongforge.interop.world import standalone_world
    from loongforge.models.building import build_standalone
    from loongforge.models.generate import generate_text

    path = Path(path).expanduser()
    is_hf = (path / CONFIG_JSON).is_file() and not (path / MANIFEST).is_file()
    family, dtype, load, own_tokenizer = _open_hf(path) if is_hf else _open_checkpoint(path, trust_code)
    if (tokenizer or own_tokenizer) is None:
        raise InteropError(f"{path}: no tokenizer.json; pass --tokenizer (byte or hf:/dir)")
    tok = _tokenizer(tokenizer or own_tokenizer)
    decoder = family.decoder
    if tok.vocab_size > decoder.vocab_size:
        raise InteropError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model in {path} "
                           f"{decoder.vocab_size}")
    with standalone_world() as backend:
        # the family's own chunk (a composed model's too), with the trained weights (a LoRA run's adapters merged)
        model = load(build_standalone(family, backend, dtype))
        return generate_text(
            model, tok, prompt, tokens, max_positions=decoder.max_position_embeddings,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        )
