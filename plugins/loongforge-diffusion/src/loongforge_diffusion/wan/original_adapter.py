"""Conversion between LoongForge's Wan parameter names and the original ones (``WanModel`` of the
Wan-Video/Wan2.1 and Wan2.2 repositories, as stored in the released ``diffusion_pytorch_model*.safetensors``).

The original model keeps q, k and v as separate linears, exactly like diffusers, so the original layout is
diffusers' layout under other names: this module renames diffusers names one-to-one and leaves fusing and
splitting to :mod:`~loongforge_diffusion.wan.diffusers_adapter`. The rename table is the one diffusers'
``scripts/convert_wan_to_diffusers.py`` applies to go the other way; note the original's ``norm3`` is the
cross-attention LayerNorm (diffusers' ``norm2``) and its ``norm1``/``norm2`` carry no parameters. Values are
never touched, so both directions are bitwise exact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from loongforge.errors import LoongForgeError

from loongforge_diffusion.wan.diffusers_adapter import from_diffusers, to_diffusers

_LINEAR = ("weight", "bias")

#: diffusers module -> original module, outside the blocks (linears, convolution and LayerNorms: weight + bias).
_TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "proj_out": "head.head",
}
#: The same inside ``blocks.<i>.``.
_BLOCK_MODULES = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "norm2": "norm3",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
#: Single parameters (RMSNorm weights, modulation tables ``[1, 6, dim]`` in a block, ``[1, 2, dim]`` in the head).
_TOP_PARAMS = {"scale_shift_table": "head.modulation"}
_BLOCK_PARAMS = {
    "attn1.norm_q.weight": "self_attn.norm_q.weight",
    "attn1.norm_k.weight": "self_attn.norm_k.weight",
    "attn2.norm_q.weight": "cross_attn.norm_q.weight",
    "attn2.norm_k.weight": "cross_attn.norm_k.weight",
    "attn2.norm_added_k.weight": "cross_attn.norm_k_img.weight",
    "scale_shift_table": "modulation",
}


def _full_table(modules: dict[str, str], params: dict[str, str]) -> dict[str, str]:
    table = {f"{theirs}.{p}": f"{orig}.{p}" for theirs, orig in modules.items() for p in _LINEAR}
    table.update(params)
    return table


_TOP = _full_table(_TOP_MODULES, _TOP_PARAMS)
_BLOCK = _full_table(_BLOCK_MODULES, _BLOCK_PARAMS)
_TOP_BACK = {orig: theirs for theirs, orig in _TOP.items()}
_BLOCK_BACK = {orig: theirs for theirs, orig in _BLOCK.items()}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _rename(name: str, top: dict[str, str], block: dict[str, str]) -> str | None:
    match = _BLOCK_KEY.match(name)
    if match:
        index, rest = match.groups()
        return f"blocks.{index}.{block[rest]}" if rest in block else None
    return top.get(name)


def diffusers_to_original_name(name: str) -> str:
    """The original name of one diffusers ``WanTransformer3DModel`` parameter."""
    renamed = _rename(name, _TOP, _BLOCK)
    if renamed is None:
        raise LoongForgeError(f"diffusers Wan parameter '{name}' has no name in the original Wan layout")
    return renamed


def original_to_diffusers_name(name: str) -> str:
    """The diffusers name of one original ``WanModel`` parameter."""
    renamed = _rename(name, _TOP_BACK, _BLOCK_BACK)
    if renamed is None:
        raise LoongForgeError(
            f"original Wan parameter '{name}' has no LoongForge counterpart (supported: the T2V, I2V and TI2V "
            "WanModel of Wan 2.1 / 2.2; FLF2V's img_emb.emb_pos, VACE and Animate parts are not)"
        )
    return renamed


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the original Wan names, splitting fused projections (``qkv`` -> ``q``/``k``/``v``)."""
    return {diffusers_to_original_name(name): tensor for name, tensor in to_diffusers(state).items()}


def _in_original_terms(message: str) -> str:
    """``message`` with every quoted diffusers parameter name replaced by its original name."""

    def original(match: re.Match[str]) -> str:
        renamed = _rename(match.group(1), _TOP, _BLOCK)
        return f"'{renamed}'" if renamed is not None else match.group(0)

    return re.sub(r"'([\w.]+)'", original, message).replace("diffusers state", "original Wan state")


def from_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original Wan names -> ours, concatenating split projections; every tensor must be used, and a
    projection whose siblings are missing (``self_attn.q`` without ``self_attn.k``) is an error naming them."""
    renamed = {original_to_diffusers_name(name): tensor for name, tensor in state.items()}
    try:
        return from_diffusers(renamed)
    except LoongForgeError as exc:
        raise LoongForgeError(_in_original_terms(str(exc))) from None
