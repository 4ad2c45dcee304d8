"""Packed rows under context parallelism: every sequence split on its own, or (dynamic CP) dealt whole.

Why per sequence: a packed row holds several conversations, and splitting the *row* into ``2*cp`` chunks
(:func:`loongforge.parallel.context.split_for_rank`) would give one rank the first conversations and another the
last, unbalancing causal work and cutting sequences at arbitrary places. Megatron's THD layout (Transformer
Engine's ``cu_seqlens_padded``) pads each sequence of length ``L`` to a multiple of ``2*cp`` and splits it
zig-zag on its own: rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` of *that* sequence, so every rank holds a
piece of every sequence and the causal work balances per sequence. Padding sits after a sequence's real tokens,
so causal attention keeps it out of their results, and its loss mask is 0.

Dynamic CP: when no sequence of a micro-batch is longer than ``parallel.dynamic_cp_threshold`` tokens, no
sequence is split at all. The sequences are dealt whole to the cp ranks (longest first, each to the rank holding
the fewest tokens) and every rank attends to its own sequences alone, with no all-to-all or ring exchange. It is
exact for the same reason context parallelism is: each token's attention is complete on the rank that holds it,
and the loss is the token-loss sum of every rank over the token count of all of them
(:func:`loongforge.parallel.context.global_mean_loss`), whichever rank holds which token.

The micro-batch's rows are flattened into one row ``[1, T]`` per rank (every rank the same ``T``: the
exchanges need equal shapes; a rank with fewer tokens gets a padding sequence of its own). Sequences are where
``position_ids`` restart at 0 (the convention of :mod:`loongforge.data.packing` and of Hugging Face's
padding-free packing); positions restart per sequence on every rank, and the model's RoPE reads them per token
(:func:`per_token_rotary`). Megatron carries the layout to every attention call as ``packed_seq_params``
(:class:`SequencePieces`, qkv format ``sbhd``: megatron's own THD paths stay off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.parallel.context import SEQUENCE_KEYS


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one sequence in a rank's local row: chunk ``chunk`` (of equal chunks of ``length``
    tokens; 0 for a whole sequence) of sequence ``sequence``, at ``start`` in the row."""

    sequence: int
    chunk: int
    start: int
    length: int


@dataclass
class SequencePieces(PackedSeqParams):
    """Where every rank's tokens come from: ``pieces[rank]`` in row order, all ranks ``local_length`` long.

    ``split``: the sequences are split over the cp ranks (attention exchanges pieces); otherwise every sequence
    is whole on one rank (attention is local)."""

    pieces: tuple[tuple[Piece, ...], ...] = ()
    split: bool = True
    local_length: int = 0

    def segments(self, rank: int) -> torch.Tensor:
        """``[local_length]`` sequence index of every token of ``rank``'s row."""
        return torch.cat([torch.full((p.length,), p.sequence, dtype=torch.long) for p in self.pieces[rank]])

    def natural_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For the rows of all ranks concatenated in rank order: the index that puts every sequence's tokens
        together and in order, and the sequence index of each token in that order."""
        keys, index = [], []
        for rank, pieces in enumerate(self.pieces):
            base = rank * self.local_length
            for p in pieces:
                keys += [(p.sequence, p.chunk)]
                index.append(torch.arange(base + p.start, base + p.start + p.length))
        order = sorted(range(len(keys)), key=keys.__getitem__)
        segments = torch.cat([torch.full((len(index[k]),), keys[k][0], dtype=torch.long) for k in order])
        return torch.cat([index[k] for k in order]), segments


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences of a flattened packed row: a sequence starts where its position is 0."""
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("packed rows must start a sequence at position 0 (position_ids restart per sequence)")
    return [end - start for start, end in zip(starts, [*starts[1:], len(position_ids)], strict=True)]


def plan_pieces(lengths: Sequence[int], cp: int, threshold: int) -> SequencePieces:
    """The layout of sequences of ``lengths`` over ``cp`` ranks: split zig-zag per sequence, or -- when
    ``threshold`` > 0 and no sequence is longer -- each sequence whole on one rank."""
    if threshold > 0 and max(lengths) <= threshold:
        return _dealt_whole(lengths, cp)
    pieces: list[list[Piece]] = [[] for _ in range(cp)]
    start = 0
    for index, length in enumerate(lengths):
        chunk = -(-length // (2 * cp))  # the sequence padded to 2*cp chunks of this many tokens
        for rank in range(cp):
            pieces[rank] += [Piece(index, rank, start, chunk), Piece(index, 2 * cp - 1 - rank, start + chunk, chunk)]
        start += 2 * chunk
    return SequencePieces(qkv_format="sbhd", pieces=tuple(map(tuple, pieces)), split=True, local_length=start,
                          max_seqlen_q=start * cp, max_seqlen_kv=start * cp)


def _dealt_whole(lengths: Sequence[int], cp: int) -> SequencePieces:
    """Longest first, each sequence to the rank with the fewest tokens (the lowest such rank); every rank's
    sequences in data order, then a padding sequence of its own up to the longest rank (rounded up to even, so
    that megatron's per-rank RoPE table of ``cp * local_length`` positions splits into ``2*cp`` chunks)."""
    owner, load = {}, [0] * cp
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(cp), key=lambda r: (load[r], r))
        owner[index], load[rank] = rank, load[rank] + lengths[index]
    local_length = max(load) + max(load) % 2
    pieces = []
    for rank in range(cp):
        mine, start = [], 0
        for index in (i for i in range(len(lengths)) if owner[i] == rank):
            mine.append(Piece(index, 0, start, lengths[index]))
            start += lengths[index]
        if start < local_length:
            mine.append(Piece(len(lengths) + rank, 0, start, local_length - start))
        pieces.append(tuple(mine))
    return SequencePieces(qkv_format="sbhd", pieces=tuple(pieces), split=False, local_length=local_length,
                          max_seqlen_q=local_length * cp, max_seqlen_kv=local_length * cp)


def split_packed_for_rank(batch: dict[str, Any], rank: int, size: int, threshold: int = 0) -> dict[str, Any]:
    """``rank``'s row ``[1, local_length]`` of a packed micro-batch (keys of :data:`SEQUENCE_KEYS`, padding with
    token 0 and loss mask 0, positions restarting per sequence) and its ``packed_seq_params``.

    Sequences without a target token (the padding tail of a packed row) are left out: they attend only to
    themselves and add nothing to the loss, so leaving them out changes no number of a dense model and spares their
    compute; it also keeps a row's padding from counting as a long sequence for dynamic CP. (A micro-batch with no
    target at all keeps its sequences.)"""
    other = sorted(set(batch) - {"attention_mask", "cu_seqlens", *SEQUENCE_KEYS})
    if other:
        raise ValueError(f"packed rows under context parallelism carry text only; this batch also has {other} "
                         "(a vision-language batch?): set data.pack: false or parallel.cp: 1")
    flat = {key: batch[key].reshape(-1) for key in SEQUENCE_KEYS}
    every = sequence_lengths(flat["position_ids"])
    bounds = torch.tensor([0, *every]).cumsum(0).tolist()
    trained = [i for i in range(len(every)) if flat["loss_mask"][bounds[i]:bounds[i + 1]].any()] or range(len(every))
    lengths, starts = [every[i] for i in trained], [bounds[i] for i in trained]
    layout = plan_pieces(lengths, size, threshold)
    source, positions = [], []
    for p in layout.pieces[rank]:
        within = p.chunk * p.length + torch.arange(p.length)
        if p.sequence < len(lengths):  # a sequence of the batch; past its end, the padding up to 2*cp chunks
            source.append(torch.where(within < lengths[p.sequence], starts[p.sequence] + within, -1))
        else:  # the rank's own padding sequence
            source.append(torch.full((p.length,), -1))
        positions.append(within)
    source = torch.cat(source)
    present = source >= 0
    part = {}
    for key in ("tokens", "labels", "loss_mask"):
        value = flat[key]
        part[key] = torch.where(present, value[source.clamp(min=0)], torch.zeros((), dtype=value.dtype))[None]
    part["position_ids"] = torch.cat(positions)[None]
    part["packed_seq_params"] = layout
    return part


def per_token_rotary(rotary: Any, position_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's RoPE table ``[positions, 1, 1, dim]`` read at each token's position (``position_ids [1, T]``):
    the rotary embedding of a flattened packed row, whose positions restart per sequence."""
    table = rotary(int(position_ids.max()) + 1, packed_seq=True)  # the whole table, not this rank's slice
    return table.index_select(0, position_ids[0].to(table.device))
