"""LLaVA-style MLP projector: vision tokens -> ``Linear -> GELU -> Linear`` -> the LLM's hidden size.

With ``merge > 1`` each ``merge x merge`` block of neighbouring patches on the encoder's row-major grid is
first concatenated into one token (pixel-unshuffle), so the LLM sees ``merge ** 2`` times fewer image tokens,
each carrying the features of the whole block. That is the cheap way to fit high-resolution encoders such as
SigLIP-so400m (729 tokens at 384px) into a short LLM context. With ``norm`` the merged tokens are LayerNormed
before ``fc1``: that is InternVL's projector, whose "pixel shuffle" (downsample ratio 0.5) concatenates each 2x2
block in the same row-major order as :func:`merge_patches`. With ``newline`` it also holds AnyRes's learned
end-of-row token (LLaVA-NeXT / OneVision's ``image_newline``, at the LLM's width): it lives in the projector because
it trains with it (LLaVA's alignment stage trains both) and :mod:`loongforge_vlm.model.anyres` places it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def merge_patches(tokens: torch.Tensor, grid: tuple[int, int], merge: int) -> torch.Tensor:
    """``(B, rows*cols, D)`` row-major -> ``(B, rows/merge * cols/merge, merge*merge*D)``, row-major over blocks.

    Each output token concatenates its block's patches in row-major order (top-left first); the grid sides
    must be multiples of ``merge`` (resize the images, or pick a merge that divides the patch grid).
    """
    rows, cols = grid
    batch, length, dim = tokens.shape
    if rows * cols != length:
        raise ValueError(f"mlp projector: grid {rows}x{cols} has {rows * cols} patches, the tokens have {length}")
    if rows % merge or cols % merge:
        raise ValueError(f"mlp projector: the {rows}x{cols} patch grid is not divisible by merge={merge}")
    blocks = tokens.reshape(batch, rows // merge, merge, cols // merge, merge, dim).permute(0, 1, 3, 2, 4, 5)
    return blocks.reshape(batch, (rows // merge) * (cols // merge), merge * merge * dim)


class MlpProjector(nn.Module):
    """``merge`` (optional) -> ``norm`` (optional) -> ``fc1 -> GELU -> fc2``; ``hidden_dim`` defaults to ``out_dim``
    as in LLaVA-1.5 (and InternVL)."""

    #: transformers' InternVL projector norm is ``nn.LayerNorm``'s default.
    NORM_EPS = 1e-5

    def __init__(self, in_dim: int, out_dim: int, *, hidden_dim: int | None = None, merge: int = 1,
                 norm: bool = False, newline: bool = False) -> None:
        super().__init__()
        if min(in_dim, out_dim, merge) <= 0 or (hidden_dim is not None and hidden_dim <= 0):
            raise ValueError(f"mlp projector: sizes must be positive, got in_dim={in_dim}, out_dim={out_dim}, "
                             f"hidden_dim={hidden_dim}, merge={merge}")
        self.merge = merge
        hidden = out_dim if hidden_dim is None else hidden_dim
        self.norm = nn.LayerNorm(in_dim * merge * merge, eps=self.NORM_EPS) if norm else None
        self.fc1 = nn.Linear(in_dim * merge * merge, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)
        self.newline = nn.Parameter(torch.randn(out_dim) * out_dim ** -0.5) if newline else None

    def output_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """The token grid the LLM sees for an encoder patch grid."""
        return grid[0] // self.merge, grid[1] // self.merge

    def forward(self, tokens: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """``(B, N, in_dim)`` -> ``(B, N / merge**2, out_dim)``.

        ``grid`` (patch rows, columns) is needed only when merging non-square grids; a square one is inferred.
        """
        if self.merge > 1:
            if grid is None:
                side = math.isqrt(tokens.shape[1])
                if side * side != tokens.shape[1]:
                    raise ValueError(f"mlp projector: {tokens.shape[1]} tokens are not a square grid; pass grid=")
                grid = (side, side)
            tokens = merge_patches(tokens, grid, self.merge)
        if self.norm is not None:
            tokens = self.norm(tokens)
        return self.fc2(nn.functional.gelu(self.fc1(tokens)))
