"""Causal attention of one chunk of a sequence over its own K/V and the recorded K/V of the earlier chunks
(``parallel.seq_chunks``; the schedule is :mod:`loongforge.parallel.sequence_chunks`).

Why not SDPA over the concatenated keys: torch's SDPA has no bottom-right causal mask on CPU without
materialising it (``chunk x sequence`` booleans, and the score matrix under the math kernel), and its
log-sum-exp output is not differentiable, so blocks cannot be merged through autograd. This uses the ring
attention's online-softmax block math (:func:`~loongforge.devices.ring_attention.merge_block`,
:func:`~loongforge.devices.ring_attention.block_gradients`) over tiles of at most :data:`TILE` tokens in global
order -- an earlier tile in full, the same tile with the causal triangle, a later one skipped -- with a hand-written,
flash-style backward that recomputes each tile's probabilities, so memory stays linear in the sequence.

The backward also routes the K/V gradients across chunks: the share for an earlier chunk's K/V is added to the
micro-batch's :class:`~loongforge.parallel.sequence_chunks.ChunkKV`, and the share the later chunks left there
for this chunk is added to its own K/V gradient (the replay runs chunks last first, so it is complete by then).
"""

from __future__ import annotations

from typing import Any

import torch

from loongforge.config.chunk_settings import TILE, chunk_tile
from loongforge.devices.ring_attention import (
    attending_pairs,
    block_gradients,
    compute_dtype,
    from_blocks,
    merge_block,
    to_blocks,
)
from loongforge.parallel.sequence_chunks import SequenceChunk
from loongforge.parallel.sequence_pieces import Piece


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: Any,
                    chunk: SequenceChunk, scale: float) -> torch.Tensor:
    """Attention of ``chunk``'s queries (megatron's ``[s, b, heads, d]``; key/value ``[s, b, groups, d]``) over
    the keys of every position up to its own, for attention layer ``layer``; ``[s, b, heads, dv]``. In the
    recording pass the chunk's K/V is kept for the later chunks."""
    if chunk.recording:
        chunk.kv.record(layer, chunk.index, key, value)
    return _ChunkAttention.apply(query, key, value, layer, chunk, scale)


def _pairs(chunk: SequenceChunk, length: int) -> list[tuple[slice, slice, bool]]:
    """The attending (query slice, key slice, diagonal) tiles of chunk ``chunk.index`` (``length`` tokens) over
    the keys of chunks ``0 .. index`` concatenated."""
    tile = chunk_tile(length, TILE)  # this module's TILE: tests shrink it
    per_chunk = length // tile
    queries = [Piece(0, chunk.index * per_chunk + t, t * tile, tile) for t in range(per_chunk)]
    keys = [Piece(0, t, t * tile, tile) for t in range((chunk.index + 1) * per_chunk)]
    return list(attending_pairs(queries, keys, causal=True))


def _keys_and_values(layer: Any, chunk: SequenceChunk, key: torch.Tensor, value: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of chunks ``0 .. index`` in block layout (the earlier ones from the record)."""
    kept = [*chunk.kv.earlier(layer, chunk.index), (key, value)]
    groups = key.shape[2]
    return (torch.cat([to_blocks(k, groups, dtype) for k, _ in kept], dim=-2),
            torch.cat([to_blocks(v, groups, dtype) for _, v in kept], dim=-2))


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: Any,
                chunk: SequenceChunk, scale: float) -> torch.Tensor:
        dtype = compute_dtype(query)
        q = to_blocks(query, key.shape[2], dtype)
        k, v = _keys_and_values(layer, chunk, key, value, dtype)
        out = q.new_zeros(*q.shape[:-1], value.shape[-1])
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for qs, ks, diagonal in _pairs(chunk, query.shape[0]):
            merge_block(q, k, v, out, lse, qs, ks, diagonal, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layer, ctx.chunk, ctx.scale = layer, chunk, scale
        return from_blocks(out, query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        layer, chunk, scale = ctx.layer, ctx.chunk, ctx.scale
        dtype, groups, length = compute_dtype(query), key.shape[2], query.shape[0]
        q, dout = to_blocks(query, groups, dtype), to_blocks(grad_out, groups, dtype)
        k, v = _keys_and_values(layer, chunk, key, value, dtype)
        delta = (dout * out).sum(dim=-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs, ks, diagonal in _pairs(chunk, length):
            block_gradients(q, k, v, dout, lse, delta, (dq, dk, dv), qs, ks, diagonal, scale)
        for index in range(chunk.index):  # the earlier chunks' K/V: their backward comes later
            part = slice(index * length, (index + 1) * length)
            chunk.kv.add_grad(layer, index, dk[..., part, :], dv[..., part, :])
        own = slice(chunk.index * length, None)
        dk_own, dv_own = dk[..., own, :], dv[..., own, :]
        if (later := chunk.kv.take_grad(layer, chunk.index)) is not None:
            dk_own, dv_own = dk_own + later[0], dv_own + later[1]
        return (from_blocks(dq, query.dtype), from_blocks(dk_own, key.dtype), from_blocks(dv_own, value.dtype),
                None, None, None)
