"""InternViT in plain torch, and exact conversion to/from transformers' ``InternVLVisionModel`` names.

One tile ``(C, S, S)`` becomes ``(S/p)**2`` patch tokens: patches are embedded by one linear layer over flattened
``(channel, row, column)`` patches (the stride-``p`` convolution as a matmul, :func:`~loongforge_vlm.encoders.siglip
.patchify`), a CLS token is put in front, the position table added, then blocks of
``x + attn_scale * attn(norm(x))`` and ``x + mlp_scale * mlp(norm(x))`` (InternViT's per-channel layer scale, exact
GELU). There is no final norm (InternVL's towers are configured with mean pooling, whose norm is an identity) and the
CLS token is dropped from the output: InternVL's projector reads the patch tokens only. Attention uses one fused
``qkv``; with QK-norm, the RMSNorm spans all heads' queries (keys), as in InternViT-6B.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from loongforge.errors import LoongForgeError
from torch import nn

from loongforge_vlm.encoders.internvit_flavors import INTERNVIT_FLAVORS, InternViTFlavor, parameter_shapes
from loongforge_vlm.encoders.recompute import run_blocks
from loongforge_vlm.encoders.siglip import patchify

__all__ = ["INTERNVIT_FLAVORS", "InternViT", "InternViTFlavor", "from_hf_state_dict", "to_hf_state_dict"]

#: transformers initialises both layer scales to this (``layer_scale_init_value``).
LAYER_SCALE_INIT = 0.1
#: transformers' QK-norm is an RMSNorm with this epsilon, whatever ``layer_norm_eps`` says.
QK_NORM_EPS = 1e-6


def _norm(flavor: InternViTFlavor) -> nn.Module:
    return nn.LayerNorm(flavor.dim, eps=flavor.eps) if flavor.norm == "layer_norm" else nn.RMSNorm(flavor.dim,
                                                                                                   eps=flavor.eps)


class InternViTAttention(nn.Module):
    """Bidirectional multi-head attention over CLS + patch tokens, optionally QK-normalised."""

    def __init__(self, flavor: InternViTFlavor) -> None:
        super().__init__()
        self.num_heads = flavor.num_heads
        self.qkv = nn.Linear(flavor.dim, 3 * flavor.dim, bias=flavor.qkv_bias)
        self.q_norm = nn.RMSNorm(flavor.dim, eps=QK_NORM_EPS) if flavor.qk_norm else None
        self.k_norm = nn.RMSNorm(flavor.dim, eps=QK_NORM_EPS) if flavor.qk_norm else None
        self.out = nn.Linear(flavor.dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class InternViTMLP(nn.Module):
    def __init__(self, flavor: InternViTFlavor) -> None:
        super().__init__()
        self.fc1 = nn.Linear(flavor.dim, flavor.ffn_dim)
        self.fc2 = nn.Linear(flavor.ffn_dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class InternViTBlock(nn.Module):
    """Pre-norm attention and MLP, each branch scaled per channel before the residual add."""

    def __init__(self, flavor: InternViTFlavor) -> None:
        super().__init__()
        self.attn_norm = _norm(flavor)
        self.attn = InternViTAttention(flavor)
        self.mlp_norm = _norm(flavor)
        self.mlp = InternViTMLP(flavor)
        self.attn_scale = nn.Parameter(torch.full((flavor.dim,), LAYER_SCALE_INIT))
        self.mlp_scale = nn.Parameter(torch.full((flavor.dim,), LAYER_SCALE_INIT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_scale * self.attn(self.attn_norm(x))
        return x + self.mlp_scale * self.mlp(self.mlp_norm(x))


class InternViT(nn.Module):
    """Tiles ``(tiles, channels, S, S)`` -> patch tokens ``(tiles, (S/p)**2, dim)``, row-major, CLS dropped."""

    #: Recompute each block in the backward (``VLMFlavor.encoder_recompute`` sets it).
    recompute = False

    def __init__(self, flavor: InternViTFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        self.patch_embed = nn.Linear(flavor.patch_dim, flavor.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, flavor.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, flavor.num_positions, flavor.dim))
        self.blocks = nn.ModuleList(InternViTBlock(flavor) for _ in range(flavor.num_layers))
        nn.init.normal_(self.pos_embed, std=flavor.dim ** -0.5)

    @property
    def out_dim(self) -> int:
        """Width of each output token (what the projector maps to the LLM width)."""
        return self.flavor.dim

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch rows and columns of a tile, which must be the trained square size."""
        size = self.flavor.image_size
        if (height, width) != (size, size):
            raise ValueError(f"internvit: tiles must be {size}x{size} pixels (the position table's size), got "
                             f"{height}x{width}; the image processor tiles images to that size")
        return self.flavor.grid_size, self.flavor.grid_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.flavor.in_channels:
            raise ValueError(f"internvit: expected pixel_values of shape (tiles, {self.flavor.in_channels}, height, "
                             f"width), got {tuple(pixel_values.shape)}")
        grid = self.grid(*pixel_values.shape[-2:])
        x = self.patch_embed(patchify(pixel_values.to(self.patch_embed.weight.dtype), self.flavor.patch_size, grid))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = run_blocks(self.blocks, x, recompute=self.recompute)
        return x[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# transformers <-> LoongForge names

#: Our name inside ``blocks.<i>.`` -> transformers' name(s) inside ``encoder.layer.<i>.`` (several: concatenated).
_BLOCK: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layernorm_before",),
    "attn.qkv": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "attn.q_norm": ("attention.q_norm",),
    "attn.k_norm": ("attention.k_norm",),
    "attn.out": ("attention.projection_layer",),
    "mlp_norm": ("layernorm_after",),
    "mlp.fc1": ("mlp.fc1",),
    "mlp.fc2": ("mlp.fc2",),
}
_SCALES = {"attn_scale": "lambda_1", "mlp_scale": "lambda_2"}
_TOP = {"cls_token": "embeddings.cls_token", "pos_embed": "embeddings.position_embeddings",
        "patch_embed.weight": "embeddings.patch_embeddings.projection.weight",
        "patch_embed.bias": "embeddings.patch_embeddings.projection.bias"}


def _hf_names(name: str) -> tuple[str, ...]:
    """transformers' name(s) of one of our parameters (several when ours is their concatenation)."""
    if name in _TOP:
        return (_TOP[name],)
    _, index, rest = name.split(".", 2)
    if rest in _SCALES:
        return (f"encoder.layer.{index}.{_SCALES[rest]}",)
    module, param = rest.rsplit(".", 1)
    return tuple(f"encoder.layer.{index}.{theirs}.{param}" for theirs in _BLOCK[module])


def _piece_shape(flavor: InternViTFlavor, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of each transformers piece of our ``name`` (the patch kernel is a convolution there)."""
    if name == "patch_embed.weight":
        return (flavor.dim, flavor.in_channels, flavor.patch_size, flavor.patch_size)
    return (shape[0] // len(_hf_names(name)), *shape[1:])


def name_map(flavor: InternViTFlavor) -> dict[str, tuple[str, ...]]:
    """Each of our parameter names -> transformers' names it is made of."""
    return {name: _hf_names(name) for name in parameter_shapes(flavor)}


def to_hf_state_dict(state: Mapping[str, torch.Tensor], flavor: InternViTFlavor, *,
                     prefix: str = "") -> dict[str, torch.Tensor]:
    """Our names -> ``InternVLVisionModel`` names under ``prefix`` (weights or tensors laid out like them). Exact:
    ``qkv`` is split and the patch matrix reshaped to a kernel. Every parameter must be present, nothing else."""
    shapes = parameter_shapes(flavor)
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise LoongForgeError(f"internvit state dict: unexpected tensor '{unknown[0]}' ({len(unknown)} in all) is not "
                              "a parameter of InternViT")
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name not in state:
            raise LoongForgeError(f"internvit state dict: missing tensor '{name}' (shape {shape})")
        if tuple(state[name].shape) != shape:
            raise LoongForgeError(f"internvit state dict: tensor '{name}' has shape {tuple(state[name].shape)}, "
                                  f"expected {shape}")
        theirs = _hf_names(name)
        pieces = state[name].reshape(-1, *_piece_shape(flavor, name, shape)[1:]).split(shape[0] // len(theirs))
        out.update({prefix + hf: piece.reshape(_piece_shape(flavor, name, shape)).clone()
                    for hf, piece in zip(theirs, pieces, strict=True)})
    return out


def from_hf_state_dict(state: Mapping[str, torch.Tensor], flavor: InternViTFlavor, *,
                       prefix: str = "") -> dict[str, torch.Tensor]:
    """``InternVLVisionModel`` names (under ``prefix``; other names are ignored) -> ours; the inverse of
    :func:`to_hf_state_dict`. A tower tensor we do not know, a missing one or a wrong shape is an error naming it."""
    tower = {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
    shapes = parameter_shapes(flavor)
    expected = {hf for name in shapes for hf in _hf_names(name)}
    unknown = sorted(set(tower) - expected)
    if unknown:
        raise LoongForgeError(f"internvit state dict: unexpected transformers tensor '{prefix}{unknown[0]}' "
                              f"({len(unknown)} in all) is not a parameter of this {flavor.num_layers}-layer tower")
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        pieces = []
        for hf in _hf_names(name):
            if hf not in tower:
                raise LoongForgeError(f"internvit state dict: missing transformers tensor '{prefix}{hf}' (for "
                                      f"'{name}')")
            piece = _piece_shape(flavor, name, shape)
            if tuple(tower[hf].shape) != piece:
                raise LoongForgeError(f"internvit state dict: transformers tensor '{prefix}{hf}' has shape "
                                      f"{tuple(tower[hf].shape)}, expected {piece}")
            pieces.append(tower[hf])
        out[name] = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).reshape(shape).clone()
    return out
