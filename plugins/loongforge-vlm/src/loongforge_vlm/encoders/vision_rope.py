"""2D rotary position embedding of the Qwen vision encoders.

Each head's channels rotate by the patch's row over the first quarter of frequencies and by its column over
the second; the ``[row, column]`` angle vector is then repeated so the rotation covers the whole head in the
rotate-half convention (channel ``i`` pairs with ``i + head_dim / 2``). Tables are computed in fp32 and the
rotation is applied in fp32, whatever the activation dtype, as in the reference.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``(tokens, head_dim)`` for ``positions`` of shape ``(tokens, 2)`` (row, column)."""
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (quarter / (head_dim // 2))
    angles = (positions.float()[..., None] * inv_freq).flatten(1)  # (tokens, [row freqs, column freqs])
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(tokens, heads, head_dim)``; returns ``x``'s dtype."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)
