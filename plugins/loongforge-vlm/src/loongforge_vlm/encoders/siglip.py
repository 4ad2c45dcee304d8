"""SigLIP vision encoder in plain torch, and exact conversion to/from transformers' ``SiglipVisionModel`` names.

The tower is a pre-LN ViT: patches are embedded by one linear layer over flattened ``(channel, row, column)``
patches (the same arithmetic as SigLIP's stride-``patch`` convolution, as a matmul), a learned position table
is added (bicubically resized when the image grid differs from the trained one, as transformers does with
``interpolate_pos_encoding=True``), then blocks of attention and GELU(tanh) MLP, and a final LayerNorm. The
output is every patch token, which is what a VLM projects into its LLM; the pooling head is not modelled (nor the
final LayerNorm of a flavor without ``post_norm``, whose checkpoint tensors are left out on import).
Attention uses one fused ``qkv`` projection; the adapter splits and concatenates it, which copies bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from loongforge.errors import LoongForgeError
from torch import nn

from loongforge_vlm.encoders.recompute import run_blocks
from loongforge_vlm.encoders.siglip_flavors import SIGLIP_FLAVORS, SiglipFlavor, parameter_shapes

__all__ = ["SIGLIP_FLAVORS", "SiglipFlavor", "SiglipVisionEncoder", "from_hf_state_dict", "name_map",
           "to_hf_state_dict"]


def patchify(pixel_values: torch.Tensor, patch_size: int, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, rows * cols, C*p*p)`` over the top-left ``grid`` of patches, each flattened
    channel-major: a convolution with a ``p``-stride kernel is then one matmul (shared by the ViT towers)."""
    batch, channels = pixel_values.shape[:2]
    rows, cols = grid
    p = patch_size
    seen = pixel_values[:, :, :rows * p, :cols * p]
    patches = seen.reshape(batch, channels, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, rows * cols, channels * p * p)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patch tokens."""

    def __init__(self, flavor: SiglipFlavor) -> None:
        super().__init__()
        self.num_heads = flavor.num_heads
        self.qkv = nn.Linear(flavor.dim, 3 * flavor.dim)
        self.out = nn.Linear(flavor.dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class SiglipMLP(nn.Module):
    def __init__(self, flavor: SiglipFlavor) -> None:
        super().__init__()
        self.fc1 = nn.Linear(flavor.dim, flavor.ffn_dim)
        self.fc2 = nn.Linear(flavor.ffn_dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipBlock(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, flavor: SiglipFlavor) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(flavor.dim, eps=flavor.eps)
        self.attn = SiglipAttention(flavor)
        self.mlp_norm = nn.LayerNorm(flavor.dim, eps=flavor.eps)
        self.mlp = SiglipMLP(flavor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class SiglipVisionEncoder(nn.Module):
    """Images ``(batch, channels, height, width)`` -> patch tokens ``(batch, patches, dim)``, row-major.

    A patch grid other than the trained one (``image_size // patch_size`` per side) needs
    ``interpolate_pos_encoding=True``: the trained position table is then resized to the new grid.
    """

    #: Recompute each block in the backward (``VLMFlavor.encoder_recompute`` sets it).
    recompute = False

    def __init__(self, flavor: SiglipFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        self.patch_embed = nn.Linear(flavor.patch_dim, flavor.dim)
        self.pos_embed = nn.Parameter(torch.empty(flavor.num_positions, flavor.dim))
        self.blocks = nn.ModuleList(SiglipBlock(flavor) for _ in range(flavor.num_layers))
        self.post_norm = nn.LayerNorm(flavor.dim, eps=flavor.eps) if flavor.post_norm else None
        nn.init.normal_(self.pos_embed, std=flavor.dim ** -0.5)

    @property
    def out_dim(self) -> int:
        """Width of each output token (what a projector maps to the LLM width)."""
        return self.flavor.dim

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Whole patch rows and columns of an image; a remainder smaller than a patch is not seen (as in the conv)."""
        p = self.flavor.patch_size
        if height < p or width < p:
            raise ValueError(f"siglip: image size {height}x{width} is smaller than one {p}x{p} patch")
        return height // p, width // p

    def patchify(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, H//p * W//p, C*p*p)``, each patch flattened channel-major like the conv kernel."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.flavor.in_channels:
            raise ValueError(f"siglip: expected pixel_values of shape (batch, {self.flavor.in_channels}, height, "
                             f"width), got {tuple(pixel_values.shape)}")
        return patchify(pixel_values, self.flavor.patch_size, self.grid(*pixel_values.shape[-2:]))

    def position_embeddings(self, rows: int, cols: int, interpolate: bool) -> torch.Tensor:
        """``(rows * cols, dim)``: the trained table, or its bicubic resize (align_corners=False) to another grid."""
        side = self.flavor.grid_size
        if (rows, cols) == (side, side):
            return self.pos_embed
        if not interpolate:
            raise ValueError(f"siglip: a {rows}x{cols} patch grid differs from the trained {side}x{side} "
                             f"({self.flavor.image_size}px); pass interpolate_pos_encoding=True to resize the "
                             f"position table")
        table = self.pos_embed.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        resized = F.interpolate(table, size=(rows, cols), mode="bicubic", align_corners=False)
        return resized.permute(0, 2, 3, 1).reshape(rows * cols, -1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        rows, cols = self.grid(*pixel_values.shape[-2:])
        x = self.patch_embed(self.patchify(pixel_values.to(self.patch_embed.weight.dtype)))
        x = x + self.position_embeddings(rows, cols, interpolate_pos_encoding)
        x = run_blocks(self.blocks, x, recompute=self.recompute)
        return x if self.post_norm is None else self.post_norm(x)


# ---------------------------------------------------------------------------------------------------------------
# transformers <-> LoongForge names

#: Our name inside ``blocks.<i>.`` -> transformers' name(s) inside ``encoder.layers.<i>.`` (several: concatenated).
_BLOCK: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layer_norm1",),
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.out": ("self_attn.out_proj",),
    "mlp_norm": ("layer_norm2",),
    "mlp.fc1": ("mlp.fc1",),
    "mlp.fc2": ("mlp.fc2",),
}
_TOP: dict[str, str] = {
    "patch_embed.weight": "embeddings.patch_embedding.weight",
    "patch_embed.bias": "embeddings.patch_embedding.bias",
    "pos_embed": "embeddings.position_embedding.weight",
    "post_norm.weight": "post_layernorm.weight",
    "post_norm.bias": "post_layernorm.bias",
}
#: transformers' attention-pooling head; a VLM uses the patch tokens, so these are dropped on import.
_POOLING_HEAD_PREFIX = "head."
#: transformers' final LayerNorm, dropped on import into a tower without one (``SiglipFlavor.post_norm`` false).
_POST_NORM_PREFIX = "post_layernorm."


def _hf_names(name: str) -> tuple[str, ...]:
    """transformers' name(s) of one of our parameters (several when ours is their concatenation)."""
    if name in _TOP:
        return (_TOP[name],)
    _, index, rest = name.split(".", 2)
    module, param = rest.rsplit(".", 1)
    return tuple(f"encoder.layers.{index}.{theirs}.{param}" for theirs in _BLOCK[module])


def _hf_shape(flavor: SiglipFlavor, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of each transformers piece of our parameter ``name`` (the patch kernel is a conv there)."""
    if name == "patch_embed.weight":
        return (flavor.dim, flavor.in_channels, flavor.patch_size, flavor.patch_size)
    pieces = len(_hf_names(name))
    return (shape[0] // pieces, *shape[1:])


def name_map(flavor: SiglipFlavor) -> dict[str, tuple[str, ...]]:
    """Each of our parameter names -> transformers' names it is made of (what module pairs are read from)."""
    return {name: _hf_names(name) for name in parameter_shapes(flavor)}


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...], name: str, side: str) -> None:
    if tuple(tensor.shape) != expected:
        raise LoongForgeError(f"siglip state dict: {side} tensor '{name}' has shape {tuple(tensor.shape)}, "
                              f"expected {expected}; does the flavor match the checkpoint?")


def to_hf_state_dict(state: Mapping[str, torch.Tensor], flavor: SiglipFlavor) -> dict[str, torch.Tensor]:
    """Our names -> ``SiglipVisionModel`` names (weights, or gradients/optimizer moments laid out like them).

    Exact: the fused ``qkv`` is split and the patch matrix reshaped to a conv kernel, both bitwise copies.
    Every parameter of the flavor must be present, and nothing else.
    """
    shapes = parameter_shapes(flavor)
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise LoongForgeError(f"siglip state dict: unexpected tensor '{unknown[0]}' (and {len(unknown) - 1} more) "
                              f"is not a parameter of SiglipVisionEncoder")
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name not in state:
            raise LoongForgeError(f"siglip state dict: missing tensor '{name}' (shape {shape})")
        tensor = state[name]
        _check_shape(tensor, shape, name, "our")
        theirs = _hf_names(name)
        piece_shape = _hf_shape(flavor, name, shape)
        pieces = tensor.split(piece_shape[0]) if len(theirs) > 1 else (tensor.reshape(piece_shape),)
        out.update({hf: piece.clone() for hf, piece in zip(theirs, pieces, strict=True)})
    return out


def from_hf_state_dict(state: Mapping[str, torch.Tensor], flavor: SiglipFlavor, *,
                       prefix: str = "") -> dict[str, torch.Tensor]:
    """``SiglipVisionModel`` names -> ours; the inverse of :func:`to_hf_state_dict`.

    ``prefix`` selects the vision tower inside a larger checkpoint (``"vision_model."`` in the published SigLIP
    files, which also hold the text tower); names outside it are ignored. The attention-pooling head
    (``head.*``) is dropped, and so is the final LayerNorm for a flavor without ``post_norm``; any other name that
    is not a tower parameter is an error naming it.
    """
    unused = (_POOLING_HEAD_PREFIX,) if flavor.post_norm else (_POOLING_HEAD_PREFIX, _POST_NORM_PREFIX)
    tower = {name[len(prefix):]: tensor for name, tensor in state.items()
             if name.startswith(prefix) and not name[len(prefix):].startswith(unused)}
    shapes = parameter_shapes(flavor)
    expected = {hf: name for name in shapes for hf in _hf_names(name)}
    unknown = sorted(set(tower) - set(expected))
    if unknown:
        raise LoongForgeError(f"siglip state dict: unexpected transformers tensor '{prefix}{unknown[0]}' "
                              f"(and {len(unknown) - 1} more) is not a parameter of a {flavor.num_layers}-layer "
                              f"SigLIP vision tower")
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        pieces = []
        for hf in _hf_names(name):
            if hf not in tower:
                raise LoongForgeError(f"siglip state dict: missing transformers tensor '{prefix}{hf}' (for '{name}')")
            _check_shape(tower[hf], _hf_shape(flavor, name, shape), prefix + hf, "transformers")
            pieces.append(tower[hf])
        out[name] = torch.cat(pieces) if len(pieces) > 1 else pieces[0].reshape(shape).clone()
    return out
