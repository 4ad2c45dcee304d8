"""Still squares: the text-to-image version of moving squares -- one frame, captioned by colour and size only.

A still is a one-frame moving-squares clip (the same palette, sizes, placement and renderer, so the scorer
applies unchanged), and its caption drops the direction token that one frame cannot show: the context is the
colour and size rows of the same embedding table (``(2, text_dim)``). Labels keep the ``(colour, direction,
size)`` layout of moving squares; the direction is whatever the underlying clip drew and means nothing here.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, caption_tokens, embedding_table

#: Caption positions a still image keeps: colour and size (not direction).
STILL_TOKENS = (0, 2)


def still_context(labels: torch.Tensor, text_dim: int) -> torch.Tensor:
    """``(..., 3)`` labels -> ``(..., 2, text_dim)`` caption states: the colour and size tokens' embeddings."""
    return embedding_table(text_dim)[caption_tokens(labels)[..., list(STILL_TOKENS)]]


class StillSquares(Dataset):
    """``length`` images ``{"image": (3, side, side), "context": (2, text_dim), "labels": (3,)}`` in [-1, 1], a
    pure function of ``(seed, index)``."""

    def __init__(self, length: int = 1024, *, text_dim: int = 32, seed: int = 0, side: int = 16) -> None:
        self.clips = MovingSquares(length, text_dim=text_dim, seed=seed, geometry=Geometry(frames=1, side=side))

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        clip = self.clips[index]
        return {"image": clip["video"][:, 0], "context": clip["context"][list(STILL_TOKENS)], "labels": clip["labels"]}
