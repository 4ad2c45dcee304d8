"""Whole Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL checkpoints to and from LoongForge checkpoints, as
``loongforge convert``
does for LLMs.

::

    loongforge convert hf-to-mcore HF_DIR OUT_DIR [--model qwen2-vl-2b]
    loongforge convert mcore-to-hf CHECKPOINT OUT_DIR [--max-shard-size 5GB]

Both go through the composed model at TP=PP=1 on CPU with core's readers and writers (safetensors index, atomic
output, manifest-verified checkpoints, ``dist_checkpointing`` so a checkpoint trained at any tp/pp converts): the
HF tensors are mapped by :mod:`loongforge_vlm.model.hf_interop`, the language model placed with core's
``load_full_state`` and read back with ``gather_full_state``. A round trip reproduces the tensors bitwise. Those
readers and writers show their progress per tensor (:mod:`loongforge.progress`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import loongforge
import torch
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import LoongForgeError
from loongforge.interop.convert import check_out_dir

from loongforge_vlm.model.flavors import FLAVORS, VLMFlavor


def registered_name(flavor: VLMFlavor, requested: str | None, where: str) -> str:
    """The registered VLM flavor equal to ``flavor`` (``requested`` must be it, when given)."""
    if requested is not None:
        if FLAVORS.get(requested) != flavor:
            raise LoongForgeError(f"{where} does not describe model '{requested}'")
        return requested
    for name, known in FLAVORS.items():
        if known == flavor:
            return name
    raise LoongForgeError(f"{where} matches no registered VLM flavor ({', '.join(FLAVORS)}); register a flavor for it")


def vision_parts(vlm: torch.nn.Module) -> tuple[str, ...]:
    """The composed model's vision modules: the encoder, and the projector when it is a separate one (InternVL)."""
    return ("encoder",) if vlm.projector is None else ("encoder", "projector")


def hf_to_loongforge(hf_dir: str | Path, out_dir: str | Path, *, model: str | None = None) -> str:
    """Convert a transformers ``*VLForConditionalGeneration`` directory to a model-only LoongForge checkpoint."""
    from loongforge.interop.hf_checkpoint import index_hf_tensors, load_hf_tensors
    from loongforge.interop.mcore_checkpoint import write_model_checkpoint
    from loongforge.interop.sharding import load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    from loongforge_vlm.model.hf_interop import from_hf, read_hf_config

    hf_dir, out_dir = Path(hf_dir).expanduser(), Path(out_dir).expanduser()
    flavor = read_hf_config(hf_dir)
    name = registered_name(flavor, model, str(hf_dir / "config.json"))
    check_out_dir(out_dir)
    tensors = load_hf_tensors(index_hf_tensors(hf_dir))
    dtype = "bf16" if all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point()) else "fp32"
    ours = from_hf(tensors, flavor)
    config = LoongForgeConfig()
    config.model.name, config.training.precision = name, dtype
    with standalone_world() as backend:
        vlm = build_standalone(flavor, backend, dtype)
        for part in vision_parts(vlm):
            getattr(vlm, part).load_state_dict({k[len(part) + 1:]: v for k, v in ours.items()
                                                if k.startswith(part + ".")})
        load_full_state([vlm.language_model], {k[len("language_model."):]: v for k, v in ours.items()
                                               if k.startswith("language_model.")})
        write_model_checkpoint(
            out_dir, vlm, config=config, hf_source=hf_dir,
            metadata={"source": str(hf_dir.resolve()), "model": name, "dtype": dtype,
                      "loongforge_version": loongforge.__version__,
                      "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        )
    return f"wrote {out_dir}: {len(tensors)} Hugging Face tensors as model '{name}' ({dtype})"


def loongforge_to_hf(checkpoint: str | Path, out_dir: str | Path, *, max_shard_size: str = "5GB",
                     trust_code: bool = False) -> str:
    """Convert a LoongForge VLM checkpoint (any tp/pp it was trained at) to a transformers directory;
    ``trust_code`` lets a ``pkg.module:attr`` name in its config.yaml import its module."""
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.hf_checkpoint import parse_size, write_hf_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        checkpoint_config,
        checkpoint_dtype,
        hf_side_files,
        load_trained_weights,
        resolve_family,
    )
    from loongforge.interop.sharding import gather_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.resolve import model_label

    from loongforge_vlm.model.hf_interop import hf_config_dict, saved_layout, to_hf

    out_dir = Path(out_dir).expanduser()
    path = find_checkpoint(checkpoint)
    config = checkpoint_config(path, trust_code=trust_code)
    flavor = resolve_family(config)
    if not isinstance(flavor, VLMFlavor) or flavor.hf_architecture is None:
        raise LoongForgeError(f"{path}: model '{model_label(config, flavor)}' has no Hugging Face VLM layout "
                              "(Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL flavors do)")
    dtype = checkpoint_dtype(path, config)
    max_bytes = parse_size(max_shard_size)
    _, carry = hf_side_files(config, path)
    check_out_dir(out_dir)
    with standalone_world() as backend:
        vlm = build_standalone(flavor, backend, dtype)
        load_trained_weights(path, [vlm], config)  # a LoRA run: its adapters folded in
        language = gather_full_state([vlm.language_model])
        state = {**{f"{part}.{k}": v for part in vision_parts(vlm) for k, v in getattr(vlm, part).state_dict().items()},
                 **{f"language_model.{k}": v for k, v in language.items()}}
    tensors = saved_layout(to_hf(state, flavor), flavor)  # file names as transformers' save_pretrained writes them
    write_hf_checkpoint(out_dir, tensors, hf_config_dict(flavor, dtype="bfloat16" if dtype == "bf16" else "float32"),
                        max_shard_bytes=max_bytes, carry_from=carry, progress=True)
    return f"wrote {out_dir}: {len(tensors)} tensors ({flavor.hf_architecture}, {dtype}) from {path}"


def configure_hf_to_loongforge(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="the registered flavor it must be (default: the one that matches)")


def configure_loongforge_to_hf(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors shard; larger models are split with an index (default 5GB)")


def run_hf_to_loongforge(args: argparse.Namespace) -> int:
    print(hf_to_loongforge(args.source, args.out, model=args.model))
    return 0


def run_loongforge_to_hf(args: argparse.Namespace) -> int:
    print(loongforge_to_hf(args.source, args.out, max_shard_size=args.max_shard_size, trust_code=args.trust_code))
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_vlm.convert is now `loongforge convert hf-to-mcore|mcore-to-hf SOURCE OUT`")
