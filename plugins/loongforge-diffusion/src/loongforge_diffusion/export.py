"""``loongforge convert mcore-to-hf CHECKPOINT OUT`` for the DiTs: a trained Wan or Qwen-Image checkpoint as the
diffusers transformer folder a pipeline loads (``WanTransformer3DModel.from_pretrained(OUT)``,
``QwenImageTransformer2DModel.from_pretrained(OUT)``): ``config.json`` with diffusers' class name and arguments, and
``diffusion_pytorch_model.safetensors`` in diffusers' tensor names. Wan 2.2 A14B's two experts become the two folders
of diffusers' pipeline, ``OUT/transformer`` (high noise) and ``OUT/transformer_2`` (low noise).

The weights are the model the checkpoint's task rebuilds (:func:`loongforge.train.task_checkpoint.load_task_model`),
so a LoRA run exports its adapters merged into the base weights -- or, with ``--lora-adapter``, the base transformer
and the adapters apart, as the ``pytorch_lora_weights.safetensors`` diffusers' ``load_lora_weights`` reads -- and
``--ema`` exports the exponential moving average the run kept instead of the trained weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loongforge.errors import LoongForgeError

#: The diffusers weights file of a transformer folder (what ``ModelMixin.from_pretrained`` reads).
WEIGHTS = "diffusion_pytorch_model.safetensors"
#: The LoRA file diffusers' ``load_lora_weights`` looks for in a directory.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def claims_dit_checkpoint(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint of a Wan or Qwen-Image DiT."""
    from loongforge.claims import checkpoint_model

    from loongforge_diffusion.qwen_image.flavors import QwenImageFlavor
    from loongforge_diffusion.wan.flavors import WanFlavor

    return isinstance(checkpoint_model(source, trust_code=trust_code), (WanFlavor, QwenImageFlavor))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ema", action="store_true",
                        help="export the exponential moving average of the weights (task.ema) instead of the trained "
                             "weights")
    parser.add_argument("--lora-adapter", action="store_true",
                        help="a LoRA run (Wan): write the base transformer and the adapters as "
                             f"{LORA_WEIGHTS} (diffusers' load_lora_weights) instead of merging them")


def run(args: argparse.Namespace) -> int:
    from loongforge.train.task_checkpoint import load_task_model

    from loongforge_diffusion.wan.lora import strip_lora

    task, model, found = load_task_model(args.source, trust_code=args.trust_code)
    if args.ema:
        model = _ema_model(task, model, found)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise LoongForgeError(f"{out}: exists and is not empty; choose a new directory")
    parts = _transformers(model, out)
    if len(parts) > 1:
        print(f"two experts (Wan 2.2 A14B): the high-noise one in {parts[0][1].name}/, the low-noise one in "
              f"{parts[1][1].name}/; a pipeline switches at boundary_ratio {model.flavor.expert_boundary}")
    for dit, directory in parts:
        adapters = _adapters(dit, found) if args.lora_adapter else None
        _write_transformer(strip_lora(dit) if adapters is not None else _merged(dit), directory, adapters, found,
                           ema=args.ema)
    return 0


def _transformers(model: Any, out: Path) -> list[tuple[Any, Path]]:
    """``(DiT, folder)`` pairs to write: the model into ``out``, or each of two experts into diffusers' pipeline
    folders under it (``transformer/`` high noise, ``transformer_2/`` low noise)."""
    from loongforge_diffusion.wan.experts import EXPERTS, RELEASED_DIRECTORIES, WanExperts

    if not isinstance(model, WanExperts):
        return [(model, out)]
    folders = RELEASED_DIRECTORIES["diffusers"]
    return [(model.expert(name), out / folders[name]) for name in EXPERTS]


def _write_transformer(model: Any, out: Path, adapters: dict[str, Any] | None, found: Path, *, ema: bool) -> None:
    from safetensors.torch import save_file

    class_name, config, tensors = diffusers_transformer(model)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out / WEIGHTS))
    if adapters is not None:
        save_file({name: tensor.contiguous() for name, tensor in adapters.items()}, str(out / LORA_WEIGHTS))
        print(f"wrote {out / LORA_WEIGHTS}: {len(adapters) // 2} LoRA adapters (diffusers' load_lora_weights)")
    (out / "config.json").write_text(json.dumps({"_class_name": class_name, **config}, indent=2) + "\n",
                                     encoding="utf-8")
    print(f"wrote {out}: {class_name} ({len(tensors)} tensors, diffusers names) from {found}"
          + (" (EMA weights)" if ema else ""))


def diffusers_transformer(model: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(diffusers class name, its constructor arguments, state dict in its names)`` of one of our DiTs."""
    from loongforge_diffusion.qwen_image import diffusers_adapter as qwen
    from loongforge_diffusion.qwen_image.model import QwenImageModel
    from loongforge_diffusion.wan import diffusers_adapter as wan

    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    if isinstance(model, QwenImageModel):
        return "QwenImageTransformer2DModel", _jsonable(qwen.diffusers_config(model.flavor)), qwen.to_diffusers(
            state, model.flavor)
    return "WanTransformer3DModel", _jsonable(wan.diffusers_config(model.flavor)), wan.to_diffusers(state)


def _merged(model: Any) -> Any:
    """LoRA adapters folded into their base weights (a model without them is returned as it is)."""
    from loongforge_diffusion.wan.lora import merge_lora

    return merge_lora(model) if any("lora_" in name for name, _ in model.named_parameters()) else model


def _adapters(model: Any, found: Path) -> dict[str, Any]:
    from loongforge_diffusion.wan.lora import diffusers_lora_state
    from loongforge_diffusion.wan.model import WanModel

    if not isinstance(model, WanModel):
        raise LoongForgeError(f"{found}: --lora-adapter exports Wan LoRA runs (this is {type(model).__name__})")
    try:
        return diffusers_lora_state(model)
    except LoongForgeError as exc:
        raise LoongForgeError(f"{found}: {exc}; export without --lora-adapter") from None


def _ema_model(task: Any, model: Any, found: Path) -> Any:
    if not task.ema.copy_average_to(model):
        raise LoongForgeError(f"{found}: the run kept no EMA of its weights (task.ema was not set); export without "
                              "--ema")
    return model


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()}
