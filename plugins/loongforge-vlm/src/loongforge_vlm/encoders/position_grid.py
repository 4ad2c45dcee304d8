"""Qwen3-VL's learned absolute positions: a square grid of embeddings resampled to each image's patch grid.

The encoder learns ``side x side`` position embeddings; an image of ``h x w`` patches gets the grid bilinearly
interpolated to ``h x w`` with aligned corners (patch row ``r`` reads grid row ``r * (side - 1) / (h - 1)``, so
the first and last patch rows and columns always take the grid's edges, whatever the resolution). Every frame of
a video gets the same positions. Computed per patch from the (row, column) the encoder's layout already holds, so
it follows the processor's block-major patch order without a separate reordering step.
"""

from __future__ import annotations

import torch


def _axis(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower and upper grid index and the upper one's weight along one axis of ``size`` patches."""
    source = index.float() * (side - 1) / size.clamp(min=2).sub(1).float()
    lower = source.floor()
    upper = (lower + 1).clamp(max=side - 1)
    return lower.long(), upper.long(), source - lower


def interpolated_positions(table: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``(patches, dim)`` position embeddings.

    ``table``: the ``(side * side, dim)`` learned grid, row-major; ``positions``: each patch's (row, column);
    ``sizes``: each patch's image (rows, columns) in patches.
    """
    side = round(table.shape[0] ** 0.5)
    top, bottom, down = _axis(positions[:, 0], sizes[:, 0], side)
    left, right, across = _axis(positions[:, 1], sizes[:, 1], side)
    corners = ((top, left, (1 - down) * (1 - across)), (top, right, (1 - down) * across),
               (bottom, left, down * (1 - across)), (bottom, right, down * across))
    return sum(table[row * side + col] * weight[:, None].to(table.dtype) for row, col, weight in corners)
