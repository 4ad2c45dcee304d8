"""Video <-> token rows, so that a rank can embed and score only its own tokens.

``patchify`` is the exact inverse of ``wan.model.unpatchify`` (channels last inside a patch). Patch embedding
is the model's strided 3D convolution applied as a matrix product to the patchified rows: each rank then
embeds just its shard (or a packed sequence embeds videos of different shapes in one product) with the
model's own weights, and no rank convolves, stores or back-propagates through the full embedded video.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_diffusion.wan.embeddings import PatchEmbed3D


def grid_of(shape: tuple[int, ...], patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """Latent ``(T, H, W)`` -> token grid ``(T/pt, H/ph, W/pw)``."""
    return tuple(n // p for n, p in zip(shape, patch, strict=True))


def patchify(video: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``(B, C, T, H, W)`` -> ``(B, tokens, pt*ph*pw*C)``, tokens frame-major, channels last inside a patch."""
    b, c = video.shape[:2]
    f, h, w = grid_of(video.shape[2:], patch)
    pt, ph, pw = patch
    x = video.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, f * h * w, pt * ph * pw * c)


def embed_patches(embed: PatchEmbed3D, patches: torch.Tensor) -> torch.Tensor:
    """``(B, n, pt*ph*pw*C)`` patch rows -> ``(B, n, dim)``, equal to ``embed`` on the video they came from."""
    weight = embed.proj.weight.permute(0, 2, 3, 4, 1).flatten(1)  # (dim, C, pt, ph, pw) -> rows' order
    return F.linear(patches.to(weight.dtype), weight, embed.proj.bias)
