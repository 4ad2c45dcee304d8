"""Conversion between LoongForge's Qwen-Image parameter names and diffusers' ``QwenImageTransformer2DModel`` ones.

Renames plus the fused projections: each stream's ``qkv`` is diffusers' ``to_q``/``to_k``/``to_v`` (image) or
``add_q_proj``/``add_k_proj``/``add_v_proj`` (text) stacked along the output dimension, so both directions are
exact (concatenation and splitting copy values bitwise). Both directions take the flavor and check the state
against its complete list of shapes, so a missing, unexpected or mis-shaped tensor is refused with its name
rather than surfacing later as a load error or, worse, a silently broadcast tensor. Works on any name -> tensor
mapping laid out like the weights: gradients and optimizer moments too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from loongforge.errors import LoongForgeError

from loongforge_diffusion.qwen_image.flavors import QwenImageFlavor, parameter_shapes

_LINEAR = ("weight", "bias")

#: Our module -> diffusers' module(s), outside the blocks. Several names mean our tensor is their concatenation.
_TOP: dict[str, tuple[str, ...]] = {
    "image_in": ("img_in",),
    "text_in.proj": ("txt_in",),
    "time_embed.mlp_in": ("time_text_embed.timestep_embedder.linear_1",),
    "time_embed.mlp_out": ("time_text_embed.timestep_embedder.linear_2",),
    "head.modulation": ("norm_out.linear",),
    "head.proj": ("proj_out",),
}
_TOP_PARAMS: dict[str, str] = {"text_in.norm.weight": "txt_norm.weight"}

#: The same inside ``blocks.<i>.`` (ours) / ``transformer_blocks.<i>.`` (diffusers), per stream.
_STREAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "img": {
        "modulation": ("img_mod.1",),
        "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "out": ("attn.to_out.0",),
        "ffn.fc1": ("img_mlp.net.0.proj",),
        "ffn.fc2": ("img_mlp.net.2",),
    },
    "txt": {
        "modulation": ("txt_mod.1",),
        "qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        "out": ("attn.to_add_out",),
        "ffn.fc1": ("txt_mlp.net.0.proj",),
        "ffn.fc2": ("txt_mlp.net.2",),
    },
}
_STREAM_PARAMS: dict[str, dict[str, str]] = {
    "img": {"norm_q.weight": "attn.norm_q.weight", "norm_k.weight": "attn.norm_k.weight"},
    "txt": {"norm_q.weight": "attn.norm_added_q.weight", "norm_k.weight": "attn.norm_added_k.weight"},
}


def _block_names() -> dict[str, tuple[str, ...]]:
    """Per-block map from our name (after ``blocks.<i>.``) to diffusers' (after ``transformer_blocks.<i>.``)."""
    names: dict[str, tuple[str, ...]] = {}
    for stream, modules in _STREAMS.items():
        for ours, theirs in modules.items():
            names.update({f"{stream}.{ours}.{p}": tuple(f"{t}.{p}" for t in theirs) for p in _LINEAR})
        names.update({f"{stream}.{ours}": (theirs,) for ours, theirs in _STREAM_PARAMS[stream].items()})
    return names


_TOP_NAMES: dict[str, tuple[str, ...]] = {
    **{f"{ours}.{p}": tuple(f"{t}.{p}" for t in theirs) for ours, theirs in _TOP.items() for p in _LINEAR},
    **{ours: (theirs,) for ours, theirs in _TOP_PARAMS.items()},
}
_BLOCK_NAMES = _block_names()


def name_map(flavor: QwenImageFlavor) -> dict[str, tuple[str, ...]]:
    """Every parameter name of ours -> its diffusers name(s), for ``flavor``'s number of layers."""
    names = dict(_TOP_NAMES)
    for index in range(flavor.num_layers):
        names.update({f"blocks.{index}.{ours}": tuple(f"transformer_blocks.{index}.{t}" for t in theirs)
                      for ours, theirs in _BLOCK_NAMES.items()})
    return names


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise LoongForgeError(f"Qwen-Image tensor '{name}' has shape {tuple(tensor.shape)}, expected {expected} "
                              "for this flavor")


def _check_names(given: Mapping[str, Any], expected: Mapping[str, Any], side: str) -> None:
    extra = sorted(set(given) - set(expected))
    if extra:
        raise LoongForgeError(f"{side} Qwen-Image tensor '{extra[0]}' has no counterpart in the other layout "
                              f"({len(extra)} unexpected in all); is the flavor (number of layers) right?")
    missing = sorted(set(expected) - set(given))
    if missing:
        raise LoongForgeError(f"{side} Qwen-Image state lacks tensor '{missing[0]}' ({len(missing)} missing in all)")


def to_diffusers(state: Mapping[str, torch.Tensor], flavor: QwenImageFlavor) -> dict[str, torch.Tensor]:
    """Our names -> diffusers' names, splitting fused projections into equal parts."""
    shapes = parameter_shapes(flavor)
    _check_names(state, shapes, "LoongForge")
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in name_map(flavor).items():
        tensor = state[ours]
        _check_shape(ours, tensor, shapes[ours])
        if len(theirs) == 1:
            out[theirs[0]] = tensor
        else:
            out.update({t: part.clone() for t, part in zip(theirs, tensor.chunk(len(theirs)), strict=True)})
    return out


def from_diffusers(state: Mapping[str, torch.Tensor], flavor: QwenImageFlavor) -> dict[str, torch.Tensor]:
    """diffusers' names -> ours, joining fused projections. Every tensor must be used and every one present."""
    shapes = parameter_shapes(flavor)
    names = name_map(flavor)
    _check_names(state, {t: ours for ours, theirs in names.items() for t in theirs}, "diffusers")
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        part_shape = (shapes[ours][0] // len(theirs), *shapes[ours][1:])
        for name in theirs:
            _check_shape(name, state[name], part_shape)
        out[ours] = state[theirs[0]] if len(theirs) == 1 else torch.cat([state[t] for t in theirs])
    return out


def diffusers_config(flavor: QwenImageFlavor) -> dict[str, Any]:
    """The ``QwenImageTransformer2DModel(**config)`` arguments that build the same network as ``flavor``."""
    return {
        "patch_size": flavor.patch_size,
        "in_channels": flavor.in_channels,
        "out_channels": flavor.out_channels,
        "num_layers": flavor.num_layers,
        "attention_head_dim": flavor.head_dim,
        "num_attention_heads": flavor.num_heads,
        "joint_attention_dim": flavor.text_dim,
        "guidance_embeds": flavor.guidance_embeds,
        "axes_dims_rope": tuple(flavor.axes_dims),
        "zero_cond_t": False,
        "use_additional_t_cond": False,
        "use_layer3d_rope": False,
    }
