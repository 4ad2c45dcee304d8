"""Conversion between LoongForge's Wan parameter names and diffusers' ``WanTransformer3DModel`` ones.

Renames plus the fused projections: our ``qkv`` is diffusers' ``to_q``/``to_k``/``to_v`` stacked along the
output dimension (likewise ``kv`` and ``kv_img``), so both directions are exact (concatenation and
splitting copy values bitwise). It works on any name -> tensor mapping: weights, and gradients or optimizer
moments laid out like them. Torch is needed only for the tensors themselves; ``diffusers_config`` is plain data.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from loongforge.errors import LoongForgeError

from loongforge_diffusion.wan.flavors import WanFlavor

_LINEAR = ("weight", "bias")

#: Our name -> diffusers' name(s), outside the blocks. Several names mean the tensor is their concatenation.
_TOP: dict[str, tuple[str, ...]] = {
    "patch_embed.proj": ("patch_embedding",),
    "time_embed.mlp_in": ("condition_embedder.time_embedder.linear_1",),
    "time_embed.mlp_out": ("condition_embedder.time_embedder.linear_2",),
    "time_embed.modulation": ("condition_embedder.time_proj",),
    "text_embed.fc1": ("condition_embedder.text_embedder.linear_1",),
    "text_embed.fc2": ("condition_embedder.text_embedder.linear_2",),
    "image_embed.norm_in": ("condition_embedder.image_embedder.norm1",),
    "image_embed.fc1": ("condition_embedder.image_embedder.ff.net.0.proj",),
    "image_embed.fc2": ("condition_embedder.image_embedder.ff.net.2",),
    "image_embed.norm_out": ("condition_embedder.image_embedder.norm2",),
    "head.proj": ("proj_out",),
}
_TOP_PARAMS: dict[str, str] = {"head.modulation": "scale_shift_table"}

#: The same inside ``blocks.<i>.``.
_BLOCK: dict[str, tuple[str, ...]] = {
    "self_attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "self_attn.out": ("attn1.to_out.0",),
    "cross_attn.q": ("attn2.to_q",),
    "cross_attn.kv": ("attn2.to_k", "attn2.to_v"),
    "cross_attn.kv_img": ("attn2.add_k_proj", "attn2.add_v_proj"),
    "cross_attn.out": ("attn2.to_out.0",),
    "norm_cross": ("norm2",),
    "ffn.fc1": ("ffn.net.0.proj",),
    "ffn.fc2": ("ffn.net.2",),
}
_BLOCK_PARAMS: dict[str, str] = {
    "self_attn.norm_q.weight": "attn1.norm_q.weight",
    "self_attn.norm_k.weight": "attn1.norm_k.weight",
    "cross_attn.norm_q.weight": "attn2.norm_q.weight",
    "cross_attn.norm_k.weight": "attn2.norm_k.weight",
    "cross_attn.norm_k_img.weight": "attn2.norm_added_k.weight",
    "modulation": "scale_shift_table",
}


def _name_table() -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(top-level, per-block) maps from every parameter name of ours to its diffusers name(s)."""
    top = {f"{ours}.{p}": tuple(f"{t}.{p}" for t in theirs) for ours, theirs in _TOP.items() for p in _LINEAR}
    top.update({ours: (theirs,) for ours, theirs in _TOP_PARAMS.items()})
    block = {f"{ours}.{p}": tuple(f"{t}.{p}" for t in theirs) for ours, theirs in _BLOCK.items() for p in _LINEAR}
    block.update({ours: (theirs,) for ours, theirs in _BLOCK_PARAMS.items()})
    return top, block


_TOP_NAMES, _BLOCK_NAMES = _name_table()
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _ours_to_theirs(name: str) -> tuple[str, ...]:
    match = _BLOCK_KEY.match(name)
    if match:
        index, rest = match.groups()
        if rest in _BLOCK_NAMES:
            return tuple(f"blocks.{index}.{t}" for t in _BLOCK_NAMES[rest])
    elif name in _TOP_NAMES:
        return _TOP_NAMES[name]
    raise LoongForgeError(f"no diffusers name for Wan parameter '{name}'")


def name_map(flavor: WanFlavor) -> dict[str, tuple[str, ...]]:
    """Every parameter name of ours -> its diffusers name(s), for ``flavor``'s number of layers (the image branch's
    names included whether or not the flavor has one)."""
    names = dict(_TOP_NAMES)
    for index in range(flavor.num_layers):
        names.update({f"blocks.{index}.{ours}": tuple(f"blocks.{index}.{t}" for t in theirs)
                      for ours, theirs in _BLOCK_NAMES.items()})
    return names


def diffusers_module_names(module: str) -> tuple[str, ...]:
    """diffusers' module name(s) of one of our linear layers (``blocks.0.self_attn.qkv`` -> ``blocks.0.attn1.to_q``,
    ``...to_k``, ``...to_v``): what a LoRA adapter on it is called there."""
    return tuple(name.removesuffix(".weight") for name in _ours_to_theirs(f"{module}.weight"))


def to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> diffusers' names, splitting fused projections into equal parts."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        theirs = _ours_to_theirs(name)
        for target, part in zip(theirs, tensor.chunk(len(theirs), dim=0), strict=True):
            out[target] = part.clone() if len(theirs) > 1 else tensor
    return out


def from_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' names -> ours. Every diffusers tensor must be used; a leftover name is an error (it would
    mean a part of the checkpoint our model does not have)."""
    wanted: dict[str, tuple[str, ...]] = {}
    for their_name in state:
        match = _BLOCK_KEY.match(their_name)
        table, prefix = (_BLOCK_NAMES, f"blocks.{match.group(1)}.") if match else (_TOP_NAMES, "")
        for ours, theirs in table.items():
            full = tuple(prefix + t for t in theirs)
            if their_name in full:
                wanted[prefix + ours] = full
                break
        else:
            raise LoongForgeError(f"diffusers Wan parameter '{their_name}' has no LoongForge counterpart")
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in wanted.items():
        missing = [t for t in theirs if t not in state]
        if missing:
            raise LoongForgeError(f"cannot build '{ours}': diffusers state lacks {missing}")
        out[ours] = state[theirs[0]] if len(theirs) == 1 else torch.cat([state[t] for t in theirs], dim=0)
    return out


def diffusers_config(flavor: WanFlavor) -> dict[str, Any]:
    """The ``WanTransformer3DModel(**config)`` arguments that build the same network as ``flavor``."""
    return {
        "patch_size": tuple(flavor.patch_size),
        "num_attention_heads": flavor.num_heads,
        "attention_head_dim": flavor.head_dim,
        "in_channels": flavor.in_channels,
        "out_channels": flavor.out_channels,
        "text_dim": flavor.text_dim,
        "freq_dim": flavor.freq_dim,
        "ffn_dim": flavor.ffn_dim,
        "num_layers": flavor.num_layers,
        "cross_attn_norm": flavor.cross_attn_norm,
        "qk_norm": "rms_norm_across_heads",
        "eps": flavor.eps,
        "image_dim": flavor.image_dim,
        "added_kv_proj_dim": flavor.dim if flavor.image_dim is not None else None,
        "rope_max_seq_len": flavor.rope_max_seq_len,
    }
