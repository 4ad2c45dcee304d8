"""Conditioning inputs of Qwen-Image: the diffusion time and the text-encoder states.

Each is its own module so that a tensor-parallel version can swap the linear layers one by one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_diffusion.qwen_image.flavors import NORM_EPS, TIME_FREQ_DIM


class FloatRMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 whatever the parameter and input dtypes, returned in the input dtype, so that
    bf16 training normalises the (large, unnormalised) text-encoder states as precisely as the reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).type_as(x)


def timestep_encoding(sigma: torch.Tensor, channels: int = TIME_FREQ_DIM, scale: float = 1000.0,
                      max_period: float = 10000.0) -> torch.Tensor:
    """``[cos, sin]`` of ``scale * sigma * max_period ** (-i / half)`` for ``sigma (B,)`` in ``[0, 1]``.

    Qwen-Image takes the noise level itself and scales it to ``[0, 1000]`` here. The operations run in the
    reference's order (frequencies first, then ``sigma * freq``, then the scale) because the angles reach 1000
    radians, where a different rounding order already moves the embedding by ~1e-5. Float32 throughout,
    whatever the model dtype: bf16 cannot resolve nearby noise levels.
    """
    half = channels // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
    angles = scale * (sigma.float()[:, None] * torch.exp(exponent)[None, :])
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


class TimeEmbedding(nn.Module):
    """Noise level -> ``temb (B, dim)``: sinusoid, then a SiLU MLP; every block and the head derive their
    modulation from it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp_in = nn.Linear(TIME_FREQ_DIM, dim)
        self.mlp_out = nn.Linear(dim, dim)

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        encoding = timestep_encoding(sigma).to(self.mlp_in.weight.dtype)
        return self.mlp_out(F.silu(self.mlp_in(encoding)))


class TextInput(nn.Module):
    """Text-encoder states (Qwen2.5-VL hidden states, 3584 wide in the real model) -> model width: an RMSNorm
    with a learned scale, then a linear projection."""

    def __init__(self, text_dim: int, dim: int) -> None:
        super().__init__()
        self.norm = FloatRMSNorm(text_dim, eps=NORM_EPS)
        self.proj = nn.Linear(text_dim, dim)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(states))
