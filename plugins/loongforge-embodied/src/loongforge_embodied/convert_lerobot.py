"""Pi0.5 weights between LeRobot / OpenPI (PyTorch ``PI05Pytorch`` safetensors) and :mod:`~loongforge_embodied.
policies.pi05_gemma`, both ways, bitwise.

LeRobot's ``PI05Policy`` saves its ``PI05Pytorch`` under ``model.``; OpenPI's PyTorch checkpoints hold the same
names without it (both are accepted on import, and older transformers' ``paligemma.language_model.model.`` /
``paligemma.vision_tower.`` layout and openpi's ``action_time_mlp_*`` names too). Every tensor is a rename except
the SigLIP tower, whose q/k/v are fused and patch kernel flattened by :mod:`loongforge_vlm.encoders.siglip`.

Two LeRobot tensors have no counterpart and are dropped on import (listed in the result): PaliGemma's
``lm_head`` (tied to the token embedding, which is kept) and the action expert's ``lm_head`` (Pi0.5 never reads
the expert's vocabulary). An export therefore lacks both; LeRobot loads it with ``strict=False`` and nothing else
missing. Commands::

    loongforge convert hf-to-mcore SRC.safetensors OUT.safetensors [--flavor pi05-base] [--set key=value ...]
    loongforge convert mcore-to-hf SRC.safetensors OUT.safetensors [--openpi]

(``SRC`` may also be a LeRobot checkpoint directory holding ``model.safetensors``.)

Our file records its flavor (the dataclass fields, JSON) in the safetensors metadata, so the way back needs no
flavor argument. Reading the source is the long part of a 3.35B conversion: it goes tensor by tensor with a progress
display (:mod:`loongforge.progress`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from loongforge.errors import LoongForgeError
from loongforge.progress import track

from loongforge_embodied.commands import safetensors_file, safetensors_header
from loongforge_embodied.policies.pi05_gemma_flavors import FLAVORS, Pi05GemmaFlavor

#: LeRobot's prefix (``PI05Policy.model``); OpenPI's files have none.
LEROBOT_PREFIX = "model."
_P = "paligemma_with_expert."
#: Where OpenPI/LeRobot keep the three stacks (under ``LEROBOT_PREFIX`` in LeRobot's files).
LANGUAGE_MODEL = _P + "paligemma.model.language_model."
ACTION_EXPERT = _P + "gemma_expert.model."
VISION_TOWER = _P + "paligemma.model.vision_tower.vision_model."
#: Ours -> theirs for the names outside the layers and the vision tower.
_TOP = {
    "projector.weight": _P + "paligemma.model.multi_modal_projector.linear.weight",
    "projector.bias": _P + "paligemma.model.multi_modal_projector.linear.bias",
    "embed_tokens.weight": LANGUAGE_MODEL + "embed_tokens.weight",
    "norm.weight": LANGUAGE_MODEL + "norm.weight",
    "expert_norm.dense.weight": ACTION_EXPERT + "norm.dense.weight",
    "expert_norm.dense.bias": ACTION_EXPERT + "norm.dense.bias",
    **{f"{head}.{p}": f"{head}.{p}" for head in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
       for p in ("weight", "bias")},
}
#: Our name inside a stream's layer -> theirs (transformers' ``GemmaDecoderLayer``).
_IN_LAYER = {f"{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"}
#: LeRobot tensors Pi0.5 never reads (see the module docstring).
UNUSED = (_P + "paligemma.lm_head.weight", _P + "gemma_expert.lm_head.weight")
#: Older names (transformers < 4.52 PaliGemma layout, openpi's Pi0 time MLP) -> the current ones.
_LEGACY = (("paligemma.language_model.model.", "paligemma.model.language_model."),
           ("paligemma.language_model.lm_head.", "paligemma.lm_head."),
           ("paligemma.vision_tower.", "paligemma.model.vision_tower."),
           ("paligemma.multi_modal_projector.", "paligemma.model.multi_modal_projector."),
           ("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out."))


def parameter_shapes(flavor: Pi05GemmaFlavor) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for ``flavor`` (the module built on the meta device: no memory)."""
    with torch.device("meta"):
        policy = flavor.build_policy()
    return {name: tuple(p.shape) for name, p in policy.state_dict().items()}


def _their_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, index, stream, rest = name.split(".", 3)
    first, _, tail = rest.partition(".")
    rest = f"{_IN_LAYER[first]}.{tail}" if first in _IN_LAYER else rest
    return f"{LANGUAGE_MODEL if stream == 'prefix' else ACTION_EXPERT}layers.{index}.{rest}"


def name_map(flavor: Pi05GemmaFlavor, *, prefix: str = LEROBOT_PREFIX) -> dict[str, tuple[str, ...]]:
    """Each of our parameter names -> LeRobot's tensor names it is made of (three for a SigLIP block's fused
    q/k/v), the names :func:`to_lerobot` writes: what ``loongforge diff --reference`` reads module pairs from."""
    from loongforge_vlm.encoders.siglip import name_map as siglip_names

    vision = siglip_names(flavor.siglip()) if flavor.cameras else {}
    return {name: tuple(prefix + VISION_TOWER + their for their in vision[name[len("vision."):]])
            if name.startswith("vision.") else (prefix + _their_name(name),) for name in parameter_shapes(flavor)}


def _check(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise LoongForgeError(f"pi05 conversion: '{name}' has shape {tuple(tensor.shape)}, the flavor expects "
                              f"{shape}; does the flavor match the checkpoint?")
    return tensor


def to_lerobot(state: Mapping[str, torch.Tensor], flavor: Pi05GemmaFlavor, *,
               prefix: str = LEROBOT_PREFIX) -> dict[str, torch.Tensor]:
    """Our state dict -> LeRobot names (``prefix=""`` for OpenPI's), every tensor copied bitwise."""
    from loongforge_vlm.encoders.siglip import to_hf_state_dict

    shapes = parameter_shapes(flavor)
    unknown = sorted(set(state) - set(shapes))
    missing = sorted(set(shapes) - set(state))
    if unknown or missing:
        raise LoongForgeError(f"pi05 conversion: our state dict has unexpected {unknown[:3]} / lacks {missing[:3]} "
                              f"for this flavor")
    out: dict[str, torch.Tensor] = {}
    vision = {name[len("vision."):]: _check(t, shapes[name], name) for name, t in state.items()
              if name.startswith("vision.")}
    if vision:
        out.update({prefix + VISION_TOWER + name: t for name, t in to_hf_state_dict(vision, flavor.siglip()).items()})
    for name, tensor in state.items():
        if not name.startswith("vision."):
            out[prefix + _their_name(name)] = _check(tensor, shapes[name], name).clone()
    return out


def _canonical(name: str) -> str:
    name = name[len(LEROBOT_PREFIX):] if name.startswith(LEROBOT_PREFIX) else name
    for old, new in _LEGACY:
        name = name.replace(old, new)
    return name


def from_lerobot(state: Mapping[str, torch.Tensor],
                 flavor: Pi05GemmaFlavor) -> tuple[dict[str, torch.Tensor], list[str]]:
    """LeRobot / OpenPI names -> ours: ``(our state dict, the dropped unused names)``; unknown names are errors."""
    from loongforge_vlm.encoders.siglip import from_hf_state_dict

    theirs = {_canonical(name): tensor for name, tensor in state.items()}
    # tied: saved under the head's name
    if LANGUAGE_MODEL + "embed_tokens.weight" not in theirs and UNUSED[0] in theirs:
        theirs[LANGUAGE_MODEL + "embed_tokens.weight"] = theirs[UNUSED[0]]
    dropped = sorted(name for name in theirs if name in UNUSED)
    shapes = parameter_shapes(flavor)
    wanted = {_their_name(name): name for name in shapes if not name.startswith("vision.")}
    vision = {name[len(VISION_TOWER):]: t for name, t in theirs.items() if name.startswith(VISION_TOWER)}
    unknown = sorted(set(theirs) - set(wanted) - set(UNUSED) - {VISION_TOWER + name for name in vision})
    if unknown:
        raise LoongForgeError(f"pi05 conversion: unexpected checkpoint tensor '{unknown[0]}' (and "
                              f"{len(unknown) - 1} more) for this flavor")
    out: dict[str, torch.Tensor] = {}
    if flavor.cameras:
        out.update({"vision." + name: t for name, t in from_hf_state_dict(vision, flavor.siglip()).items()})
    for their, ours in wanted.items():
        if their not in theirs:
            raise LoongForgeError(f"pi05 conversion: the checkpoint lacks '{their}' (for '{ours}')")
        out[ours] = _check(theirs[their], shapes[ours], their).clone()
    return out, dropped


def _flavor(name: str, settings: Sequence[str]) -> Pi05GemmaFlavor:
    if name not in FLAVORS:
        raise LoongForgeError(f"unknown flavor {name!r}; known: {', '.join(FLAVORS)}")
    overrides = {}
    for item in settings:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    return FLAVORS[name].with_overrides(**overrides)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, read one at a time with progress."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = list(handle.keys())
        return {name: handle.get_tensor(name) for name in track(names, f"reading {Path(path).name}", unit="tensor")}


def configure_from_lerobot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="pi05-base",
                        help="the registered policy flavor the checkpoint is (default pi05-base)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="flavor field override")


def configure_to_lerobot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--openpi", action="store_true", help="no 'model.' prefix (OpenPI's PyTorch layout)")


def run_from_lerobot(args: argparse.Namespace) -> int:
    """LeRobot/OpenPI ``args.source`` (a safetensors file, or a directory holding ``model.safetensors``) ->
    our safetensors ``args.out``, with the flavor in its metadata."""
    from safetensors.torch import save_file

    flavor = _flavor(args.flavor, args.set)
    state, dropped = from_lerobot(read_tensors(safetensors_file(args.source)), flavor)
    save_file(state, args.out, metadata={"flavor": json.dumps(dataclasses.asdict(flavor))})
    print(f"wrote {len(state)} tensors to {args.out}; dropped unused {dropped}")
    return 0


def run_to_lerobot(args: argparse.Namespace) -> int:
    """Our safetensors ``args.source`` (flavor in its metadata) -> LeRobot's (or OpenPI's) layout at ``args.out``."""
    from safetensors.torch import save_file

    fields = json.loads(safetensors_header(args.source).get("__metadata__", {}).get("flavor", "null") or "null")
    if fields is None:
        raise LoongForgeError(f"{args.source} has no flavor metadata (write it with lerobot-to-loongforge)")
    state = to_lerobot(read_tensors(args.source), Pi05GemmaFlavor(**fields), prefix="" if args.openpi else
                       LEROBOT_PREFIX)
    save_file(state, args.out)
    print(f"wrote {len(state)} tensors to {args.out}")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit(
        "python -m loongforge_embodied.convert_lerobot is now `loongforge convert hf-to-mcore|mcore-to-hf SOURCE OUT`")
