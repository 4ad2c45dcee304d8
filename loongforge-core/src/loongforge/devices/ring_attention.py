"""Context-parallel attention without Transformer Engine: ring attention over the load-balanced chunk layout.

Why a ring next to Ulysses (:mod:`loongforge.devices.ulysses`): Ulysses splits the attention heads over the cp
ranks, so heads and K/V groups must divide by cp. A ring keeps every head on every rank: each rank keeps its
queries, the K/V blocks travel once around the context-parallel ring (point-to-point, the next block in flight
while the current one is computed), and the partial results of each block are merged with the log-sum-exp of
their scores (online softmax, fp32). Works whatever the head count; costs cp-1 K/V hops per layer.

Layout: rank ``r`` of ``cp`` holds chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` equal chunks (megatron's
``get_batch_on_this_cp_rank``), so under a causal mask every rank does the same work. Attention runs per pair of
a query chunk and a key chunk: an earlier key chunk is attended in full, the same chunk with a causal triangle,
a later one is skipped. The functions take the pieces each ring member holds (which chunk of which sequence, where
in its row), so the same code serves the hybrid mode, where a Ulysses all-to-all inside sub-groups first gathers
``2*a2a`` chunks per rank (:func:`member_pieces`), and packed rows, where every sequence is split on its own
(:mod:`loongforge.parallel.sequence_pieces`) and only pieces of the same sequence attend to each other.

Backward is written by hand, flash-attention style: from the saved inputs, the merged output and its
log-sum-exp, each block's probabilities are recomputed, so memory stays linear in the sequence; K/V gradients
travel the ring with their blocks and arrive back at their owner after the last hop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from loongforge.devices import ulysses
from loongforge.parallel.sequence_pieces import Piece


def zigzag_pieces(cp: int, local_length: int) -> list[tuple[Piece, Piece]]:
    """One sequence over ``cp`` ranks of ``local_length`` tokens: rank ``r`` holds chunks ``r`` and ``2*cp-1-r``."""
    half = local_length // 2
    return [(Piece(0, r, 0, half), Piece(0, 2 * cp - 1 - r, half, half)) for r in range(cp)]


def member_pieces(rank_pieces: Sequence[Sequence[Piece]], local_length: int, a2a: int) -> list[tuple[Piece, ...]]:
    """The pieces each ring member holds after the Ulysses all-to-all of its sub-group (``a2a`` consecutive cp
    ranks, their rows of ``local_length`` concatenated in rank order); ``a2a=1``: the cp ranks' own."""
    return [tuple(Piece(p.sequence, p.chunk, u * local_length + p.start, p.length)
                  for u in range(a2a) for p in rank_pieces[j * a2a + u])
            for j in range(len(rank_pieces) // a2a)]


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring_group: Any,
                               a2a_group: Any = None, *, causal: bool, scale: float,
                               pieces: Sequence[Sequence[Piece]] | None = None) -> torch.Tensor:
    """Attention over a sequence split across the context-parallel ranks (``[s, b, n, d]`` in and out).

    Plain ring attention over ``ring_group`` (the whole cp group); hybrid when ``a2a_group`` is given: a Ulysses
    all-to-all over heads inside that sub-group, then the ring across the sub-groups (``ring_group`` holds one
    rank of each, in sub-group order; see :func:`loongforge.parallel.context.hybrid_groups`). ``pieces`` (per cp
    rank) lays out packed sequences; None: one sequence in ``2*cp`` chunks.
    """
    a2a = 1 if a2a_group is None else dist.get_world_size(a2a_group)
    local_length = query.shape[0]
    if a2a > 1:
        query, key, value = (ulysses.seq_to_heads(t, a2a_group) for t in (query, key, value))
    cp = a2a * dist.get_world_size(ring_group)
    pieces = zigzag_pieces(cp, local_length) if pieces is None else pieces
    out = ring_attention(query, key, value, ring_group, member_pieces(pieces, local_length, a2a), causal, scale)
    return out if a2a == 1 else ulysses.heads_to_seq(out, a2a_group)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                   pieces: Sequence[Sequence[Piece]], causal: bool, scale: float) -> torch.Tensor:
    """Exact attention of this rank's queries over the keys/values of every member of ``group``.

    ``query`` is megatron's ``[s, b, heads, d]``, ``key``/``value`` ``[s, b, groups, d]`` / ``[s, b, groups, dv]``
    (``heads`` a multiple of ``groups``: query head ``n`` reads group ``n // (heads // groups)``); ``pieces[m]``
    lays out member ``m``'s local sequence (which chunk of which sequence sits where; pieces of one sequence have
    one length). ``causal=False`` attends to everything of the same sequence. Returns ``[s, b, heads, dv]`` in
    the query's dtype.
    """
    return _RingAttention.apply(query, key, value, group, tuple(map(tuple, pieces)), causal, scale)


def _relation(query_chunk: int, key_chunk: int, causal: bool) -> str | None:
    """``"full"``, ``"diagonal"`` (causal triangle) or None (masked out) for a pair of chunks."""
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else None


def attending_pairs(query_pieces: Sequence[Piece], key_pieces: Sequence[Piece], causal: bool):
    """``(query slice, key slice, diagonal)`` for every pair of pieces of one sequence that attends (the query and
    the key pieces may lie in different tensors: ``start`` is where each sits in its own)."""
    for q in query_pieces:
        for k in key_pieces:
            kind = _relation(q.chunk, k.chunk, causal) if q.sequence == k.sequence else None
            if kind is not None:
                yield slice(q.start, q.start + q.length), slice(k.start, k.start + k.length), kind == "diagonal"


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """Scaled scores ``[b, g, rep, sq, sk]`` (fp32), the upper triangle at -inf for a diagonal block."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return scores


def merge_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                qs: slice, ks: slice, diagonal: bool, scale: float) -> None:
    """Online softmax: fold the attention of queries ``qs`` over keys ``ks`` into the running ``out`` and its
    log-sum-exp ``lse`` (in place; blocks as :func:`to_blocks` lays them out, in the compute dtype)."""
    scores = _scores(q[..., qs, :], k[..., ks, :], scale, diagonal)
    block_lse = torch.logsumexp(scores, dim=-1)
    block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), v[..., ks, :])
    merged = torch.logaddexp(lse[..., qs], block_lse)
    out[..., qs, :] = (out[..., qs, :] * torch.exp(lse[..., qs] - merged).unsqueeze(-1)
                       + block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse[..., qs] = merged


def block_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], qs: slice, ks: slice,
                    diagonal: bool, scale: float) -> None:
    """Add one block's share to the gradients ``grads = (dq, dk, dv)`` (in place), flash-attention style: the
    block's probabilities recomputed from the merged log-sum-exp ``lse``; ``delta`` is ``rowsum(dO * O)``, so that
    ``dS = P * (dP - delta)``. K/V gradients are summed over the query heads that share a group."""
    dq, dk, dv = grads
    probs = torch.exp(_scores(q[..., qs, :], k[..., ks, :], scale, diagonal) - lse[..., qs].unsqueeze(-1))
    dv[..., ks, :] += torch.matmul(probs.transpose(-1, -2), dout[..., qs, :]).sum(dim=2, keepdim=True)
    dprobs = torch.matmul(dout[..., qs, :], v[..., ks, :].transpose(-1, -2))
    dscores = probs * (dprobs - delta[..., qs].unsqueeze(-1)) * scale
    dq[..., qs, :] += torch.matmul(dscores, k[..., ks, :])
    dk[..., ks, :] += torch.matmul(dscores.transpose(-1, -2), q[..., qs, :]).sum(dim=2, keepdim=True)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: scores, softmax statistics and gradient sums never run in half precision."""
    return torch.promote_types(x.dtype, torch.float32)


def to_blocks(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[s, b, n, d]`` -> ``[b, groups, n // groups, s, d]`` (query heads grouped by the K/V head they read)."""
    s, b, n, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(b, groups, n // groups, s, d).to(dtype).contiguous()


def from_blocks(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`to_blocks`, cast to ``dtype``."""
    b, g, rep, s, d = x.shape
    return x.reshape(b, g * rep, s, d).permute(2, 0, 1, 3).to(dtype)


def _shift(tensors: Sequence[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """Start sending ``tensors`` to the next ring member and receiving the previous member's; returns the receive
    buffers and the requests to wait on."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    following = dist.get_global_rank(group, (rank + 1) % size)
    preceding = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, following, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, preceding, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                pieces: tuple[tuple[Piece, ...], ...], causal: bool, scale: float) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        groups = key.shape[2]
        q = to_blocks(query, groups, compute_dtype(query))
        kv = [to_blocks(key, groups, key.dtype), to_blocks(value, groups, value.dtype)]  # [b, g, 1, s, d]
        out = q.new_zeros(*q.shape[:-1], value.shape[-1])
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for step in range(size):
            source = (rank - step) % size
            incoming, requests = _shift(kv, group) if step < size - 1 else (kv, [])
            k, v = (t.to(q.dtype) for t in kv)
            for qs, ks, diagonal in attending_pairs(pieces[rank], pieces[source], causal):
                merge_block(q, k, v, out, lse, qs, ks, diagonal, scale)
            _wait(requests)
            kv = incoming
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.pieces, ctx.causal, ctx.scale = group, pieces, causal, scale
        return from_blocks(out, query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        group, pieces, causal, scale = ctx.group, ctx.pieces, ctx.causal, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        groups = key.shape[2]
        dtype = compute_dtype(query)
        q, dout = to_blocks(query, groups, dtype), to_blocks(grad_out, groups, dtype)
        kv = [to_blocks(key, groups, key.dtype), to_blocks(value, groups, value.dtype)]
        # Softmax backward: dS = P * (dP - rowsum(dO * O)), with P recomputed from the merged log-sum-exp.
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(q)
        # The gradient of the K/V block currently held (summed in the compute dtype); it travels with its block.
        dkv = [torch.zeros_like(t, dtype=dtype) for t in kv]
        for step in range(size):
            source = (rank - step) % size
            incoming, requests = _shift(kv, group) if step < size - 1 else (kv, [])
            (k, v), (dk, dv) = (t.to(dtype) for t in kv), dkv
            for qs, ks, diagonal in attending_pairs(pieces[rank], pieces[source], causal):
                block_gradients(q, k, v, dout, lse, delta, (dq, dk, dv), qs, ks, diagonal, scale)
            _wait(requests)
            kv = incoming
            if size > 1:  # after the last hop the gradients are back with the block's owner
                dkv, requests = _shift(dkv, group)
                _wait(requests)
        dk, dv = dkv
        return (from_blocks(dq, query.dtype), from_blocks(dk, key.dtype), from_blocks(dv, value.dtype),
                None, None, None, None)
