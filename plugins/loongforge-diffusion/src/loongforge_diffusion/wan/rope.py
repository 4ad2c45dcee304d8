"""Wan's 3D rotary position embedding: each head's channels are split between the frame, row and column axes.

The split follows the reference exactly: rows and columns get ``2 * (head_dim // 6)`` channels each and frames
the rest. A ``head_dim // 3`` split agrees with it only when ``head_dim // 3`` is even (it differs at 16, 64).
Channel pairs are interleaved (``x[2i], x[2i+1]`` rotate together), and each axis computes its frequencies over
its own width, ``theta ** (-2i / axis_dim)``.

The angles are computed on the fly in float64 and returned in float32, never stored as buffers: buffers would
follow ``model.to(bfloat16)`` and lose precision (complex buffers even lose their imaginary part under a real
``.to(dtype)``). A small cache keyed by the grid keeps the cost at one computation per video shape.
"""

from __future__ import annotations

import functools

import torch


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels given to (frames, rows, columns) of one attention head."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


@functools.lru_cache(maxsize=32)
def rope_tables(head_dim: int, grid: tuple[int, int, int], theta: float, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each ``(frames*rows*cols, head_dim // 2)`` float32, tokens in
    frame-major order (the order patch embedding flattens them in)."""
    per_axis = []
    for length, width in zip(grid, axis_dims(head_dim)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
        per_axis.append(torch.outer(torch.arange(length), inv_freq))
    frames, rows, cols = grid
    angles = torch.cat(
        [
            per_axis[0][:, None, None, :].expand(frames, rows, cols, -1),
            per_axis[1][None, :, None, :].expand(frames, rows, cols, -1),
            per_axis[2][None, None, :, :].expand(frames, rows, cols, -1),
        ],
        dim=-1,
    ).reshape(frames * rows * cols, head_dim // 2)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, tokens, heads, head_dim)`` pairwise; computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
