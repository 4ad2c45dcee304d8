"""``loongforge convert hf-to-mcore`` and ``mcore-to-hf``.

Both directions go through a megatron model built at TP=PP=1 on CPU, so they use exactly the code paths a
run uses: :func:`~loongforge.interop.sharding.load_full_state` to place HF weights into a model,
``dist_checkpointing`` to save it (and to reshard any training checkpoint on load), and
:func:`~loongforge.interop.sharding.gather_full_state` to read it back. Every input is validated before
anything is written; outputs appear atomically.
"""

from __future__ import annotations

import time
from pathlib import Path

import loongforge
from loongforge.checkpoint.carried_tokenizer import carried_tokenizer, hf_tokenizer_dir
from loongforge.checkpoint.layout import find_checkpoint
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.interop.hf_checkpoint import (
    check_hf_tensors,
    index_hf_tensors,
    load_hf_tensors,
    parse_size,
    write_hf_checkpoint,
)
from loongforge.interop.mcore_checkpoint import (
    HF_SOURCE,
    checkpoint_config,
    checkpoint_dtype,
    hf_side_files,
    load_trained_model,
    resolve_family,
    write_model_checkpoint,
)
from loongforge.models.hf_adopt import name_model
from loongforge.models.hf_format import read_hf_model


def check_out_dir(out_dir: Path) -> None:
    """Refuse an output directory that exists and is not empty: a conversion never writes over anything."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InteropError(f"{out_dir}: already exists and is not empty; choose a new output directory")


def _recorded_tokenizer(hf_dir: Path, out_dir: Path) -> str:
    """``data.tokenizer`` of the checkpoint converted from ``hf_dir`` into ``out_dir``: the copy of the source's
    tokenizer in ``hf_source/``, the descriptor's kind, or empty when the source carries none -- never a default
    that would claim a tokenizer the weights were not trained with."""
    carried = carried_tokenizer(hf_dir)
    if carried is not None and hf_tokenizer_dir(carried) is not None:
        return f"hf:{out_dir.resolve() / HF_SOURCE}"
    return carried or ""


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, model: str | None = None) -> str:
    """Convert the HF checkpoint in ``hf_dir`` to a model-only LoongForge checkpoint; return a summary line."""
    from loongforge.interop.sharding import load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    hf_dir, out_dir = Path(hf_dir).expanduser(), Path(out_dir).expanduser()
    hf = read_hf_model(hf_dir)
    infos = index_hf_tensors(hf_dir)
    dtype = check_hf_tensors(infos, hf.family, hf_dir)
    name, overrides = name_model(hf.family, model, str(hf.path))
    check_out_dir(out_dir)
    config = LoongForgeConfig()
    config.model.name, config.model.overrides = name, overrides
    config.training.precision = "bf16" if dtype == "bf16" else "fp32"
    config.data.tokenizer = _recorded_tokenizer(hf_dir, out_dir)
    tensors = load_hf_tensors(infos)
    with standalone_world() as backend:
        megatron_model = build_standalone(hf.family, backend, dtype)
        load_full_state([megatron_model], hf.family.hf_adapter().from_hf(tensors))
        write_model_checkpoint(
            out_dir, megatron_model, config=config, hf_source=hf_dir,
            metadata={"source": str(hf_dir.resolve()), "model": name, "dtype": dtype,
                      "loongforge_version": loongforge.__version__,
                      "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        )
    shown = f"{name} with overrides {overrides}" if overrides else name
    return f"wrote {out_dir}: {len(tensors)} Hugging Face tensors as model '{shown}' ({dtype})"


def mcore_to_hf(checkpoint: str | Path, out_dir: str | Path, *, max_shard_size: str = "5GB",
                trust_code: bool = False) -> str:
    """Convert a LoongForge checkpoint (any TP/PP layout) to a HF directory; return a summary line.

    The model is rebuilt by its family (``build_chunk`` at TP=PP=1) and exported by the family's
    ``hf_adapter()``, so a plugin family converts the same way as core's; one without an adapter is refused.
    ``trust_code`` lets a ``pkg.module:attr`` model name in the checkpoint's config import its module.
    """
    from loongforge.interop.sharding import gather_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.resolve import model_label

    out_dir = Path(out_dir).expanduser()
    path = find_checkpoint(checkpoint)
    config = checkpoint_config(path, trust_code=trust_code)
    family = resolve_family(config)
    adapter = family.hf_adapter()
    if adapter is None:
        raise InteropError(f"{path}: model '{model_label(config, family)}' has no Hugging Face "
                           "counterpart to convert to (its family supplies no hf_adapter)")
    dtype = checkpoint_dtype(path, config)
    max_bytes = parse_size(max_shard_size)
    base, carry = hf_side_files(config, path)
    hf_config = adapter.config_json(dtype, base)
    check_out_dir(out_dir)
    with standalone_world() as backend:
        megatron_model = load_trained_model(path, build_standalone(family, backend, dtype), config)
        full = gather_full_state([megatron_model])
    tensors = adapter.to_hf(full)
    write_hf_checkpoint(out_dir, tensors, hf_config, max_shard_bytes=max_bytes, carry_from=carry, progress=True)
    architecture = (hf_config.get("architectures") or [family.family_name])[0]
    return f"wrote {out_dir}: {len(tensors)} tensors ({architecture}, {dtype}) from {path}"
