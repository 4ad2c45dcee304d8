"""Wan's 3D rotary position embedding: each head's channels are split between the frame, row and column axes.

The split follows the reference exactly: rows and columns get ``2 * (head_dim // 6)`` channels each and frames
the rest. A ``head_dim // 3`` split agrees with it only when ``head_dim // 3`` is even (it differs at 16, 64).
Channel pairs are interleaved (``x[2i], x[2i+1]`` rotate together), and each axis computes its frequencies over
its own width, ``theta ** (-2i / axis_dim)``.

The table is real: ``(tokens, head_dim // 2, 2)`` float32 holding ``(cos, sin)`` of each pair's angle (what
``torch.view_as_real`` makes of ``exp(i angle)``), so it can be an input of a compiled block -- TorchInductor
generates no code for complex tensors. How a pair is rotated depends on who runs it: eagerly, one complex
multiplication (``view_as_complex`` of both operands, zero-copy), measured ~3x faster than the cos/sin form on CPU
for the same values; under ``torch.compile``, the cos/sin form, which Inductor fuses with the surrounding norm into
one kernel (the complex op would fall back to eager and split the graph). The angles are computed in float64 on
the fly, never stored as a buffer (buffers follow ``model.to(bfloat16)``); a small cache keyed by the grid keeps
the cost at one computation per video shape, and the table is built outside any compiled graph.
"""

from __future__ import annotations

import functools

import torch


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels given to (frames, rows, columns) of one attention head."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


@torch.compiler.disable
@functools.lru_cache(maxsize=32)
def rope_table(head_dim: int, grid: tuple[int, int, int], theta: float, device: torch.device) -> torch.Tensor:
    """``(cos, sin)`` of every angle, shape ``(frames*rows*cols, head_dim // 2, 2)``, float32, tokens in
    frame-major order (the order patch embedding flattens them in). Not traced by ``torch.compile`` (which would
    bypass the cache and rebuild the table in every step's graph)."""
    per_axis = []
    for length, width in zip(grid, axis_dims(head_dim), strict=True):
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
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, tokens, heads, head_dim)`` pairwise by ``table (tokens, head_dim // 2, 2)``
    (see :func:`rope_table`); computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():
        cos, sin = table[:, None, :, 0], table[:, None, :, 1]
        real, imag = pairs.unbind(-1)
        rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    else:
        rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.view_as_complex(table)[:, None])
    return rotated.flatten(-2).type_as(x)
