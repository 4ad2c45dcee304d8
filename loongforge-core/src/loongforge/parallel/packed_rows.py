"""Packed rows attended sequence by sequence (varlen) instead of through a dense block-diagonal mask.

Why: a packed row holds several samples back to back, and each token may see only the earlier tokens of its own
sample. A dense ``[b, 1, s, s]`` mask says so at the cost of ``s * s`` entries per row (64 MiB of bool per 8K row,
four times that once SDPA turns it into additive floats) and of attention over the whole square, most of which the
mask then throws away. Flash-attention's varlen kernels and Transformer Engine's THD format take the sample
boundaries instead, as ``cu_seqlens``: the cumulative lengths over the micro-batch's tokens flattened row by row.
:class:`PackedRows` carries those boundaries to megatron's core attention as ``packed_seq_params``; core's
:class:`~loongforge.devices.sdpa_attention.SDPAttention` runs plain causal attention on each sequence (equal-length
sequences batched into one call), so no ``s * s`` tensor exists.

The rows keep megatron's ``[s, b]`` layout (qkv format ``sbhd``), so megatron's own THD paths (which flatten the
batch and restart RoPE per sequence) stay off and RoPE runs as for any row: within a sequence it sees the same
distances as in the unpacked sample, which is what makes packing exact (:mod:`loongforge.data.packing`).

A core attention that cannot read the layout (Transformer Engine's, a plugin's own) gets the dense mask
instead (:meth:`PackedRows.dense_mask`, :func:`attend_packed`): the same numbers, the old memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

#: The batch key of packed rows' sequence boundaries (int32, over the ``b * s`` tokens flattened row by row).
CU_SEQLENS = "cu_seqlens"


@dataclass
class PackedRows(PackedSeqParams):
    """The sequences of ``rows`` packed rows of ``row_length`` tokens: ``cu_seqlens_q`` (= ``cu_seqlens_kv``) are
    their boundaries over the rows flattened one after another; every row end is a boundary. ``max_seqlen_q``/``kv``
    are the row length (a bound on every sequence's): megatron sizes the RoPE table of a row by them."""

    rows: int = 0
    row_length: int = 0
    #: ``(length, count)`` of each set of equal-length sequences, in the order :attr:`order` lists them.
    groups: tuple[tuple[int, int], ...] = ()
    #: The flattened rows' token indices, sequences of one length together (each group ``[count, length]``).
    order: torch.Tensor | None = field(default=None, repr=False)
    #: Where each flattened token lands in :attr:`order` (its inverse).
    restore: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, rows: int, row_length: int) -> PackedRows:
        """The layout of ``rows`` rows of ``row_length`` tokens cut at ``cu_seqlens``; ``ValueError`` in one line when
        the boundaries do not increase from 0 to ``rows * row_length`` or a sequence crosses a row end."""
        bounds = [int(x) for x in cu_seqlens.reshape(-1).tolist()]
        total = rows * row_length
        if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b <= a for a, b in pairwise(bounds)):
            raise ValueError(f"cu_seqlens must increase from 0 to {total} (rows x row length), got {bounds}")
        ends = set(bounds)
        crossed = [r * row_length for r in range(1, rows) if r * row_length not in ends]
        if crossed:
            raise ValueError(f"cu_seqlens {bounds} let a sequence cross the row end at token {crossed[0]} "
                             f"(rows of {row_length} tokens)")
        lengths = [b - a for a, b in pairwise(bounds)]
        by_length: dict[int, list[int]] = {}
        for start, length in zip(bounds, lengths, strict=False):  # the last bound starts nothing
            by_length.setdefault(length, []).append(start)
        order = torch.cat([(torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1)
                           for length, starts in by_length.items()])
        tensor = torch.tensor(bounds, dtype=torch.int32)
        return cls(qkv_format="sbhd", cu_seqlens_q=tensor, cu_seqlens_kv=tensor, max_seqlen_q=row_length,
                   max_seqlen_kv=row_length, rows=rows, row_length=row_length,
                   groups=tuple((length, len(starts)) for length, starts in by_length.items()), order=order,
                   restore=torch.argsort(order))

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> PackedRows:
        """The layout of ``[b, s]`` rows whose tokens carry their sequence's id (a sequence is a run of one id)."""
        rows, row_length = segments.shape
        change = torch.ones_like(segments, dtype=torch.bool)
        change[:, 1:] = segments[:, 1:] != segments[:, :-1]
        starts = torch.nonzero(change.reshape(-1)).flatten()
        return cls.from_cu_seqlens(torch.cat([starts, torch.tensor([rows * row_length])]), rows, row_length)

    def row_spans(self) -> list[list[tuple[int, int]]]:
        """Each row's ``(start, end)`` sequence spans, in row positions."""
        spans: list[list[tuple[int, int]]] = [[] for _ in range(self.rows)]
        bounds = self.cu_seqlens_q.tolist()
        for start, end in pairwise(bounds):
            row = start // self.row_length
            spans[row].append((start - row * self.row_length, end - row * self.row_length))
        return spans

    def segments(self) -> torch.Tensor:
        """``[b, s]`` sequence index of every token (counted over the whole micro-batch)."""
        lengths = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).long()
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        return ids.reshape(self.rows, self.row_length)

    def dense_mask(self) -> torch.Tensor:
        """The same attention as megatron's ``[b, 1, s, s]`` block-diagonal causal mask (``True`` = masked out), for
        attention that cannot take the layout."""
        from loongforge.data.packing import block_causal_mask

        return block_causal_mask(self.segments())


def attend_packed(batch: dict[str, Any], *, varlen: bool) -> dict[str, Any]:
    """``batch`` with its :data:`CU_SEQLENS` replaced by what the model's attention reads: ``packed_seq_params``
    (:class:`PackedRows`) when ``varlen``, else the dense block-diagonal ``attention_mask``."""
    rows, row_length = batch["tokens"].shape
    layout = PackedRows.from_cu_seqlens(batch[CU_SEQLENS], rows, row_length)
    out = {key: value for key, value in batch.items() if key != CU_SEQLENS}
    if varlen:
        out["packed_seq_params"] = layout
    else:
        out["attention_mask"] = layout.dense_mask()
    return out
