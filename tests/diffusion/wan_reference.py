"""Shared helpers for the Wan parity tests: tiny flavors for each task and the error measures.

Head dims 16 and 64 are used because there a ``head_dim // 3`` RoPE split would differ from Wan's
``2 * (head_dim // 6)`` one (16 // 3 = 5 and 64 // 3 = 21 are odd), so a wrong split cannot pass.
"""

from __future__ import annotations

import torch
from loongforge_diffusion.wan.flavors import FLAVORS, WanFlavor

#: diffusers cuts the context at 512 text tokens to find the CLIP image tokens (I2V), so I2V tests use 512.
DIFFUSERS_I2V_TEXT_LEN = 512


def tiny_flavor(task: str, head_dim: int) -> WanFlavor:
    return FLAVORS["wan-tiny"].with_overrides(
        task=task, dim=2 * head_dim, num_heads=2, ffn_dim=48, text_dim=16, freq_dim=32, in_channels=5,
        out_channels=4, image_dim=24 if task == "i2v" else None, per_token_timesteps=task == "ti2v",
    )


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def max_abs(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item()
