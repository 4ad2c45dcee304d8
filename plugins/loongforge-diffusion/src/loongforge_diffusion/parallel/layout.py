"""``TokenLayout``: which video tokens a rank holds and which tokens each may attend to.

The Wan blocks take their attention kernels from a layout (see ``wan.attention.attend``). A layout describes
one token sequence made of one or more packed videos -- each with its own text (and CLIP image) context packed
the same way -- optionally split into contiguous shards over a :class:`ContextParallel` group.

Packed attention runs per video (a slice of the queries against the same video's keys) rather than with a
block-diagonal mask: the result is the same SDPA call a video alone would make, no ``tokens x tokens`` mask is
ever built, and no work is spent on masked-out pairs. Under context parallelism, self-attention first
exchanges sequence for heads (Ulysses), so each rank sees every token of its heads and the per-video slices
are those of the whole sequence; cross-attention needs no exchange, since contexts are replicated and each
local query slice meets the context of the video it belongs to.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loongforge_diffusion.parallel.collectives import heads_to_seq, seq_to_heads
from loongforge_diffusion.parallel.group import ContextParallel
from loongforge_diffusion.wan.attention import attend


def spans(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive pieces of the given lengths."""
    ends = list(itertools.accumulate(lengths))
    return list(zip([0, *ends[:-1]], ends, strict=True))


@dataclass(frozen=True)
class TokenLayout:
    """``videos``: tokens of each packed video in sequence order (one entry for an unpacked batch).
    ``texts`` / ``images``: each video's number of text / image context tokens in the packed contexts, or
    ``None`` when every token attends to the whole context (unpacked). ``cp``: shards over a group, or ``None``."""

    videos: tuple[int, ...]
    texts: tuple[int, ...] | None = None
    images: tuple[int, ...] | None = None
    cp: ContextParallel | None = None

    @property
    def tokens(self) -> int:
        return sum(self.videos)

    def local_span(self) -> tuple[int, int]:
        """``[start, end)`` of this rank's tokens in the whole sequence."""
        return (0, self.tokens) if self.cp is None else self.cp.span(self.tokens)

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(B, local tokens, H, D)`` each -> ``(B, local tokens, H*D)``."""
        if self.cp is None:
            return self._per_video(q, k, v)
        heads = q.shape[2]
        whole = seq_to_heads(torch.cat([q, k, v]), self.cp.group)  # one exchange for all three
        out = self._per_video(*whole.chunk(3)).unflatten(-1, (heads // self.cp.size, -1))
        return heads_to_seq(out, self.cp.group).flatten(2)

    def text_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._against_context(q, k, v, self.texts)

    def image_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._against_context(q, k, v, self.images)

    def _per_video(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Block-diagonal self-attention over the whole sequence: each video attends to itself only."""
        if len(self.videos) == 1:
            return attend(q, k, v)
        return torch.cat([attend(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in spans(self.videos)], dim=1)

    def _against_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         lengths: tuple[int, ...] | None) -> torch.Tensor:
        """Each local query attends to its own video's slice of the packed context."""
        if lengths is None:
            return attend(q, k, v)
        if len(lengths) != len(self.videos):
            raise ValueError(f"packed layout: {len(self.videos)} videos but {len(lengths)} context lengths")
        start, end = self.local_span()
        pieces = []
        for (a, b), (c, d) in zip(spans(self.videos), spans(lengths), strict=True):
            a, b = max(a, start), min(b, end)
            if a < b:
                pieces.append(attend(q[:, a - start:b - start], k[:, c:d], v[:, c:d]))
        return torch.cat(pieces, dim=1)
