"""Conversion between :class:`~loongforge_vlm.encoders.qwen_vit.QwenViT` names and transformers' vision tower.

transformers' ``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel`` /
``Qwen3VLVisionModel`` differ from ours by renames plus two layout changes, both exact: the patch embedding is
their Conv3d kernel ``(dim, C, t, p, p)`` flattened to ``(dim, C*t*p*p)`` (a view of the same values), and
Qwen2.5-VL's ``fc1`` is their ``gate_proj`` and ``up_proj`` stacked along the output dimension. Both
directions check the state against the flavor's complete list of shapes, so a missing, unexpected or mis-shaped
tensor is refused with its name.
Works on any name -> tensor mapping laid out like the weights (gradients, optimizer moments too).

``prefix`` selects the tower inside a whole VLM checkpoint (``"model.visual."`` in transformers 5 layouts,
``"visual."`` in the published files); tensors outside the prefix belong to the language model and are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from loongforge.errors import LoongForgeError

from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor, parameter_shapes

#: Qwen3-VL's names of the MLP and merger layers (Qwen2-VL's ``fc1``/``mlp.0`` are its ``linear_fc1``).
_QWEN3_LINEARS = {"fc1": "linear_fc1", "fc2": "linear_fc2"}


def _merger_map(flavor: QwenViTFlavor) -> dict[str, tuple[str, ...]]:
    if not flavor.learned_positions:
        return {"merger.fc1": ("merger.mlp.0",), "merger.fc2": ("merger.mlp.2",), "merger.norm": ("merger.ln_q",)}
    mergers = {"merger": "merger", **{f"deepstack_mergers.{level}": f"deepstack_merger_list.{level}"
                                      for level in range(len(flavor.deepstack_layers))}}
    return {f"{ours}.{part}": (f"{theirs}.{_QWEN3_LINEARS.get(part, part)}",)
            for ours, theirs in mergers.items() for part in ("norm", "fc1", "fc2")}


def _module_map(flavor: QwenViTFlavor) -> dict[str, tuple[str, ...]]:
    """Our module -> their module(s); several names mean our tensor is their concatenation along dim 0."""
    if flavor.gated_mlp:
        mlp = {"mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp.fc2": ("mlp.down_proj",)}
    else:
        linears = _QWEN3_LINEARS if flavor.learned_positions else {}
        mlp = {f"mlp.{name}": (f"mlp.{linears.get(name, name)}",) for name in ("fc1", "fc2")}
    block = {"attn.qkv": ("attn.qkv",), "attn.out": ("attn.proj",), **mlp, "attn_norm": ("norm1",),
             "mlp_norm": ("norm2",)}
    modules = {**_merger_map(flavor), "patch_embed": ("patch_embed.proj",), "pos_embed": ("pos_embed",)}
    for index in range(flavor.num_layers):
        modules.update({f"blocks.{index}.{ours}": tuple(f"blocks.{index}.{t}" for t in theirs)
                        for ours, theirs in block.items()})
    return modules


def name_map(flavor: QwenViTFlavor) -> dict[str, tuple[str, ...]]:
    """Every parameter name of ours -> its transformers name(s) (without prefix)."""
    names = {"patch_embed.weight": ("patch_embed.proj.weight",)}
    modules = _module_map(flavor)
    for ours in parameter_shapes(flavor):
        if ours not in names:
            module, _, param = ours.rpartition(".")
            names[ours] = tuple(f"{t}.{param}" for t in modules[module])
    return names


def hf_shapes(flavor: QwenViTFlavor) -> dict[str, tuple[int, ...]]:
    """Every transformers parameter name (without prefix) and its shape."""
    ours = parameter_shapes(flavor)
    shapes = {"patch_embed.proj.weight": (flavor.dim, flavor.in_channels, flavor.temporal_patch_size,
                                          flavor.patch_size, flavor.patch_size)}
    for name, theirs in name_map(flavor).items():
        if name != "patch_embed.weight":
            first, *rest = ours[name]
            shapes.update({t: (first // len(theirs), *rest) for t in theirs})
    return shapes


_HINT = "is the flavor right (family, num_layers)?"


def _check(state: Mapping[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str) -> None:
    for name, shape in expected.items():
        if name not in state:
            raise LoongForgeError(f"{what} lacks tensor '{name}' of shape {shape}; {_HINT}")
        if tuple(state[name].shape) != shape:
            raise LoongForgeError(f"{what}: '{name}' has shape {tuple(state[name].shape)}, expected {shape}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise LoongForgeError(f"{what}: '{extra[0]}' has no counterpart ({len(extra)} unexpected tensor(s)); {_HINT}")


def from_hf(state: Mapping[str, torch.Tensor], flavor: QwenViTFlavor, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """transformers' vision-tower state -> ours."""
    theirs = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    _check(theirs, hf_shapes(flavor), f"transformers {flavor.family} vision state dict")
    out = {}
    for ours, names in name_map(flavor).items():
        tensors = [theirs[t] for t in names]
        out[ours] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    out["patch_embed.weight"] = out["patch_embed.weight"].reshape(flavor.dim, flavor.patch_dim)
    return out


def to_hf(state: Mapping[str, torch.Tensor], flavor: QwenViTFlavor, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """Our state -> transformers' vision-tower names (with ``prefix`` prepended)."""
    _check(state, parameter_shapes(flavor), f"loongforge {flavor.family} vision state dict")
    shapes = hf_shapes(flavor)
    out = {}
    for ours, names in name_map(flavor).items():
        parts = state[ours].chunk(len(names)) if len(names) > 1 else (state[ours],)
        out.update({prefix + t: part.reshape(shapes[t]) for t, part in zip(names, parts, strict=True)})
    return out
