"""One Wan transformer block: AdaLN-modulated self-attention, cross-attention, AdaLN-modulated FFN.

The six modulation vectors (shift, scale, gate for attention; the same for the FFN) are the block's own
learned table plus the time embedding's projection, so every block shares one time MLP yet modulates
differently. Normalisation and the modulated residual adds run in float32, as in the reference, so bf16
training does not drift from it. Each modulation is one fused multiply-add (``torch.addcmul``) instead of a
multiply and an add over the whole activation, which eagerly saves one pass over it per modulation (the DiT's
element-wise work dominates a small model's step); compiled, Inductor fuses either form.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_diffusion.wan.attention import CrossAttention, SelfAttention
from loongforge_diffusion.wan.norms import FloatLayerNorm


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def modulate(norm: FloatLayerNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` in float32, returned in ``x``'s dtype."""
    return torch.addcmul(shift, norm(x.float()), 1 + scale).type_as(x)


def gated_residual(x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + branch * gate`` in float32, returned in ``x``'s dtype."""
    return torch.addcmul(x.float(), branch.float(), gate).type_as(x)


class WanBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float, *, cross_attn_norm: bool,
                 with_image: bool) -> None:
        super().__init__()
        self.norm_attn = FloatLayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, num_heads, eps)
        self.norm_cross = FloatLayerNorm(dim, eps=eps) if cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(dim, num_heads, eps, with_image=with_image)
        self.norm_ffn = FloatLayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = FeedForward(dim, ffn_dim)
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, context: torch.Tensor, image_context: torch.Tensor | None,
                time_mod: torch.Tensor, rope: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """``time_mod (B, N, 6, dim)`` with N = 1 or one row per token (per-token timesteps); ``layout`` (packed
        videos, context parallelism) chooses the attention kernels, see ``attention.attend``."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = (self.modulation + time_mod.float()).unbind(2)
        attn = self.self_attn(modulate(self.norm_attn, x, shift_a, scale_a), rope, layout)
        x = gated_residual(x, attn, gate_a)
        x = x + self.cross_attn(self.norm_cross(x), context, image_context, layout)
        ffn = self.ffn(modulate(self.norm_ffn, x, shift_f, scale_f))
        return gated_residual(x, ffn, gate_f)
