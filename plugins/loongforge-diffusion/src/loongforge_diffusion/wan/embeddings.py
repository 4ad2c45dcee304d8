"""Input embeddings of the Wan DiT: video patches, diffusion time, text tokens and (I2V) CLIP image tokens.

Each is its own module so that a tensor-parallel version can swap the linear layers one by one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_diffusion.wan.norms import FloatLayerNorm


class PatchEmbed3D(nn.Module):
    """Cuts the video latent into non-overlapping ``(pt, ph, pw)`` patches and projects each to ``dim``.

    A strided 3D convolution, as in the reference, so that its weights convert one-to-one.
    """

    def __init__(self, in_channels: int, dim: int, patch_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """``(B, C, T, H, W)`` -> ``(B, tokens, dim)`` with tokens in frame, row, column order."""
        return self.proj(video).flatten(2).transpose(1, 2).contiguous()


def sinusoidal_embedding(timestep: torch.Tensor, channels: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[cos, sin]`` of ``timestep * max_period ** (-i / half)``: the DDPM/Wan encoding of a (fractional)
    timestep in ``[0, 1000]``; float32 whatever the model dtype, because bf16 cannot resolve nearby steps."""
    half = channels // 2
    exponent = torch.arange(half, dtype=torch.float32, device=timestep.device) * (-math.log(max_period) / half)
    angles = timestep.float()[..., None] * torch.exp(exponent)
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


class TimeEmbedding(nn.Module):
    """Timestep -> ``temb`` (used by the head) and the six AdaLN modulation vectors every block adds to its
    own table: shift/scale/gate for self-attention and for the FFN."""

    def __init__(self, freq_dim: int, dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp_in = nn.Linear(freq_dim, dim)
        self.mlp_out = nn.Linear(dim, dim)
        self.modulation = nn.Linear(dim, 6 * dim)

    def forward(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``timestep (B, N)`` with N = 1 (one per sample) or N = tokens (Wan 2.2 TI2V) ->
        ``temb (B, N, dim)`` and ``modulation (B, N, 6, dim)``."""
        freqs = sinusoidal_embedding(timestep, self.freq_dim).to(self.mlp_in.weight.dtype)
        temb = self.mlp_out(F.silu(self.mlp_in(freqs)))
        return temb, self.modulation(F.silu(temb)).unflatten(-1, (6, -1))


class TextProjection(nn.Module):
    """Projects text-encoder states (umT5, 4096 wide in the real models) to the model width."""

    def __init__(self, text_dim: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(text_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(context), approximate="tanh"))


class ImageProjection(nn.Module):
    """Wan 2.1 I2V: projects CLIP image tokens to the model width (LayerNorm, GELU MLP, LayerNorm)."""

    def __init__(self, image_dim: int, dim: int) -> None:
        super().__init__()
        self.norm_in = FloatLayerNorm(image_dim)
        self.fc1 = nn.Linear(image_dim, image_dim)
        self.fc2 = nn.Linear(image_dim, dim)
        self.norm_out = FloatLayerNorm(dim)

    def forward(self, image_tokens: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.fc2(F.gelu(self.fc1(self.norm_in(image_tokens)))))

