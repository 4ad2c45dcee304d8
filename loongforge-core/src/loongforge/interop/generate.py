"""``loongforge generate``: a quick look at what a checkpoint writes, from either checkpoint kind.

A directory with ``config.json`` and no ``manifest.json`` is read as a Hugging Face checkpoint, anything
else as a LoongForge checkpoint (a step directory, a checkpoint root with ``latest``, or a converted one).
The model is built at TP=PP=1 on CPU and filled by the same loaders conversion uses, so what this prints
is what a converted or trained model computes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loongforge.checkpoint.manifest import MANIFEST
from loongforge.interop.errors import InteropError
from loongforge.interop.hf_config import CONFIG_JSON


def _open_hf(path: Path) -> tuple[Any, str, Callable[[Any], None], str | None]:
    from loongforge.interop.hf_checkpoint import check_hf_tensors, index_hf_tensors, load_hf_tensors
    from loongforge.interop.hf_config import read_hf_config
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.builder import padded_vocab_size
    from loongforge.models.hf_adapter import hf_to_megatron

    flavor = read_hf_config(path).flavor
    infos = index_hf_tensors(path)
    dtype = check_hf_tensors(infos, flavor, path)

    def load(model: Any) -> None:
        vocab = padded_vocab_size(flavor.vocab_size)
        load_full_state([model], hf_to_megatron(load_hf_tensors(infos), flavor, padded_vocab_size=vocab))

    return flavor, dtype, load, f"hf:{path}" if (path / "tokenizer.json").is_file() else None


def _open_checkpoint(path: Path) -> tuple[Any, str, Callable[[Any], None], str | None]:
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        HF_SOURCE,
        checkpoint_config,
        checkpoint_dtype,
        load_model_weights,
        resolve_flavor,
    )

    path = find_checkpoint(path)
    config = checkpoint_config(path)
    own = path / HF_SOURCE
    tokenizer = f"hf:{own}" if (own / "tokenizer.json").is_file() else config.data.tokenizer
    return resolve_flavor(config), checkpoint_dtype(path, config), lambda m: load_model_weights(path, [m]), tokenizer


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
) -> str:
    """``prompt`` and its continuation by the model in ``path`` (greedy unless ``temperature > 0``)."""
    from loongforge.data.tokenizers import load_tokenizer
    from loongforge.interop.world import standalone_world
    from loongforge.models.builder import build_model
    from loongforge.train.generate import generate_text

    path = Path(path).expanduser()
    is_hf = (path / CONFIG_JSON).is_file() and not (path / MANIFEST).is_file()
    flavor, dtype, load, own_tokenizer = _open_hf(path) if is_hf else _open_checkpoint(path)
    if (tokenizer or own_tokenizer) is None:
        raise InteropError(f"{path}: no tokenizer.json; pass --tokenizer (byte or hf:/dir)")
    tok = load_tokenizer(tokenizer or own_tokenizer)
    if tok.vocab_size > flavor.vocab_size:
        raise InteropError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model in {path} {flavor.vocab_size}")
    with standalone_world() as backend:
        model = build_model(flavor, backend=backend, params_dtype=dtype)
        load(model)
        return generate_text(
            model, tok, prompt, tokens, max_positions=flavor.max_position_embeddings,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        )
