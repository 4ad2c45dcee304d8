"""Causal attention over the indexer's selected keys (DeepSeek sparse attention), MLA-shaped heads.

Tensors are ``[batch, seq, heads, dim]``: queries ``q`` ``[B, S, H, Dk]``, keys ``k`` ``[B, T, G, Dk]`` and values
``v`` ``[B, T, G, Dv]`` with ``G`` dividing ``H`` (query head ``h`` reads key/value group ``h // (H / G)``) and
``Dk != Dv`` allowed. That covers both forms of MLA:

- expanded (what transformers' ``DeepseekV32Attention`` and megatron's MLA feed their core attention): ``G = H``,
  per-head keys ``[k_nope, k_rope]`` and values from ``kv_b_proj``;
- absorbed (DeepSeek's inference form): ``G = 1``, the key is the shared latent ``[kv_latent, k_rope]``
  (``Dk = kv_lora_rank + rope``), the value the latent itself, and the query ``[q_nope W_uk, q_rope]``; the
  ``[B, S, H, kv_lora_rank]`` output is then projected by ``W_uv`` per head (:func:`absorb_mla`).

``indices`` ``[B, S, K]`` (int) name the keys query ``s`` may attend to; a slot is used when ``0 <= index <=
position(s)`` (causal; ``-1`` pads), and the valid indices of a row must be distinct (the indexer's are).

Two implementations, equal within fp32 rounding:

- :func:`sparse_attention_reference`: builds the ``[B, S, T]`` mask from the indices (``-inf`` elsewhere and
  above the diagonal), full ``[B, H, S, T]`` scores, softmax -- the dense-masked definition;
- :func:`sparse_attention`: blocks of queries, each gathering only its ``K`` selected keys/values
  (``[block, K, G, D]``), so scores are ``[block, H, K]``; a custom autograd function saves only the inputs, the
  output and the per-row log-sum-exp and recomputes a block's scores in backward (flash-attention style), adding
  the key/value gradients back with ``index_add_``. Memory: ``O(S * H * Dv)`` kept, ``O(block * K * (G * Dk + H))``
  transient; never ``[S, T]``.
"""

from __future__ import annotations

import torch

from loongforge.models.sparse_attention.indexer import BLOCK_ELEMENTS, _positions


def topk_mask(indices: torch.Tensor, keys: int, query_offset: int | None = None) -> torch.Tensor:
    """``[B, S, keys]`` bool: ``True`` where ``indices`` selects a key and the key is not in the future."""
    batch, seq, _ = indices.shape
    positions = _positions(seq, keys, query_offset, indices.device)
    valid = (indices >= 0) & (indices <= positions[:, None])
    mask = torch.zeros(batch, seq, keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(valid, indices, keys), True)  # invalid slots land on the dropped extra column
    return mask[..., :keys]


def sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                               scale: float, query_offset: int | None = None) -> torch.Tensor:
    """Dense-masked reference: ``softmax(q k^T * scale + mask) v`` with the ``[S, T]`` mask from ``indices``
    (and causality). Output ``[B, S, H, Dv]`` in ``q``'s dtype; a row with no usable key gives zeros."""
    batch, seq, heads, _ = q.shape
    keys, groups = k.shape[1], k.shape[2]
    allowed = topk_mask(indices, keys, query_offset).unsqueeze(1)  # [B, 1, S, T]
    qh = q.float().transpose(1, 2)
    kh = k.float().repeat_interleave(heads // groups, dim=2).transpose(1, 2)
    vh = v.float().repeat_interleave(heads // groups, dim=2).transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    any_key = allowed.any(-1, keepdim=True)
    # rows with no key softmax over zeros (finite) and are then zeroed, so their gradients stay finite too
    scores = scores.masked_fill(~allowed & any_key, float("-inf")).masked_fill(~any_key, 0.0)
    probs = torch.softmax(scores, dim=-1) * any_key
    return torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)


def _gather(flat: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return flat.index_select(0, rows.reshape(-1)).view(shape).float()


class QueryBlocks:
    """Blocks of queries for the gather-based kernels here and in :mod:`.losses`: ``(start, stop)`` pairs, and per
    block the selected key rows and their validity.

    ``per_query`` is the number of fp32 elements one query needs in a block; blocks hold about
    :data:`~.indexer.BLOCK_ELEMENTS` of them unless ``block_size`` is given."""

    def __init__(self, indices: torch.Tensor, keys: int, per_query: int, query_offset: int | None,
                 block_size: int | None) -> None:
        self.batch, self.seq, self.width = indices.shape
        self.keys = keys
        self.positions = _positions(self.seq, keys, query_offset, indices.device)
        self.base = (torch.arange(self.batch, device=indices.device) * keys)[:, None, None]
        self.block = block_size or max(1, min(self.seq, BLOCK_ELEMENTS // max(1, self.batch * per_query)))

    def __iter__(self):
        for start in range(0, self.seq, self.block):
            yield start, min(self.seq, start + self.block)

    def select(self, indices: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row numbers ``[B, n, K]`` into keys flattened to ``[B * T, ...]`` (invalid slots read their batch's row
        0) and the validity ``[B, n, K]`` (``0 <= index <= position``)."""
        idx = indices[:, start:stop].long()
        valid = (idx >= 0) & (idx <= self.positions[start:stop, None])
        return idx.clamp(min=0) + self.base, valid


def _attention_blocks(q: torch.Tensor, k: torch.Tensor, v_dim: int, indices: torch.Tensor,
                      query_offset: int | None, block_size: int | None) -> QueryBlocks:
    # per query: gathered keys and values plus two [H, K] score tensors
    per_query = indices.shape[-1] * (k.shape[2] * (k.shape[-1] + v_dim) + 2 * q.shape[2])
    return QueryBlocks(indices, k.shape[1], per_query, query_offset, block_size)


def _block_scores(q_blk: torch.Tensor, k_sel: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, n, G, R, K]`` scaled scores, ``-inf`` at invalid slots."""
    scores = torch.einsum("bngrd,bnkgd->bngrk", q_blk, k_sel) * scale
    return scores.masked_fill_(~valid[:, :, None, None, :], float("-inf"))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, query_offset, block_size, head_sum):
        blocks = _attention_blocks(q, k, v.shape[-1], indices, query_offset, block_size)
        batch, seq, heads, dk = q.shape
        groups, dv = k.shape[2], v.shape[-1]
        reps = heads // groups
        k_flat, v_flat = k.reshape(-1, groups, dk), v.reshape(-1, groups, dv)
        out = torch.empty(batch, seq, heads, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, seq, groups, reps, dtype=torch.float32, device=q.device)
        summed = torch.zeros(batch, seq, blocks.width, dtype=torch.float32, device=q.device) if head_sum else None
        for start, stop in blocks:
            n = stop - start
            rows, valid = blocks.select(indices, start, stop)
            k_sel = _gather(k_flat, rows, (batch, n, blocks.width, groups, dk))
            v_sel = _gather(v_flat, rows, (batch, n, blocks.width, groups, dv))
            scores = _block_scores(q[:, start:stop].float().view(batch, n, groups, reps, dk), k_sel, valid, scale)
            row_lse = torch.logsumexp(scores, dim=-1)
            row_lse = row_lse.masked_fill(torch.isinf(row_lse), 0.0)  # no key: probabilities exp(-inf) = 0
            probs = torch.exp(scores - row_lse[..., None])
            lse[:, start:stop] = row_lse
            out[:, start:stop] = torch.einsum("bngrk,bnkgd->bngrd", probs, v_sel).reshape(batch, n, heads, dv)
            if head_sum:
                summed[:, start:stop] = probs.sum(dim=(2, 3))
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.args = (scale, query_offset, block_size)
        if head_sum:
            ctx.mark_non_differentiable(summed)
            return out, summed
        return out

    @staticmethod
    def backward(ctx, d_out, *_):
        q, k, v, indices, out, lse = ctx.saved_tensors
        scale, query_offset, block_size = ctx.args
        blocks = _attention_blocks(q, k, v.shape[-1], indices, query_offset, block_size)
        batch, seq, heads, dk = q.shape
        groups, dv = k.shape[2], v.shape[-1]
        reps = heads // groups
        k_flat, v_flat = k.reshape(-1, groups, dk), v.reshape(-1, groups, dv)
        dq = torch.empty(batch, seq, heads, dk, dtype=torch.float32, device=q.device)
        dk_flat = torch.zeros(k_flat.shape, dtype=torch.float32, device=q.device)
        dv_flat = torch.zeros(v_flat.shape, dtype=torch.float32, device=q.device)
        for start, stop in blocks:
            n = stop - start
            rows, valid = blocks.select(indices, start, stop)
            k_sel = _gather(k_flat, rows, (batch, n, blocks.width, groups, dk))
            v_sel = _gather(v_flat, rows, (batch, n, blocks.width, groups, dv))
            q_blk = q[:, start:stop].float().view(batch, n, groups, reps, dk)
            probs = torch.exp(_block_scores(q_blk, k_sel, valid, scale) - lse[:, start:stop, ..., None])
            do_blk = d_out[:, start:stop].float().view(batch, n, groups, reps, dv)
            delta = (do_blk * out[:, start:stop].float().view(batch, n, groups, reps, dv)).sum(-1, keepdim=True)
            flat_rows = rows.reshape(-1)
            dv_flat.index_add_(0, flat_rows, torch.einsum("bngrk,bngrd->bnkgd", probs, do_blk).reshape(-1, groups, dv))
            d_scores = probs * (torch.einsum("bngrd,bnkgd->bngrk", do_blk, v_sel) - delta) * scale
            dq[:, start:stop] = torch.einsum("bngrk,bnkgd->bngrd", d_scores, k_sel).reshape(batch, n, heads, dk)
            d_keys = torch.einsum("bngrk,bngrd->bnkgd", d_scores, q_blk)
            dk_flat.index_add_(0, flat_rows, d_keys.reshape(-1, groups, dk))
        return (dq.to(q.dtype), dk_flat.view(k.shape).to(k.dtype), dv_flat.view(v.shape).to(v.dtype),
                None, None, None, None, None)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float, *,
                     query_offset: int | None = None, block_size: int | None = None,
                     return_head_sum: bool = False):
    """Causal attention of each query over its selected keys only; output ``[B, S, H, Dv]`` in ``q``'s dtype.

    With ``return_head_sum`` also returns the attention probabilities summed over the heads at each selected slot,
    ``[B, S, K]`` fp32 (0 at unused slots; no gradient) -- the target of the indexer's sparse KL loss.
    ``query_offset`` is the position of query 0 among the keys (default ``T - S``). Differentiable in ``q``, ``k``
    and ``v``; the indices carry no gradient."""
    if q.shape[2] % k.shape[2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q [B, S, H, Dk], "
                         "k [B, T, G, Dk], v [B, T, G, Dv] with G dividing H")
    if indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices {tuple(indices.shape)} do not match queries {tuple(q.shape[:2])}")
    result = _SparseAttention.apply(q, k, v, indices, scale, query_offset, block_size, return_head_sum)
    return result


@torch.no_grad()
def sparse_head_sum(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scale: float, *,
                    query_offset: int | None = None, block_size: int | None = None) -> torch.Tensor:
    """The sparse attention probabilities summed over heads at each selected slot, ``[B, S, K]`` fp32 (0 at unused
    slots) -- what :func:`sparse_attention` returns with ``return_head_sum``, without values or gradient."""
    batch, _, heads, dk = q.shape
    groups = k.shape[2]
    blocks = _attention_blocks(q, k, 0, indices, query_offset, block_size)
    k_flat = k.reshape(-1, groups, dk)
    summed = torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    for start, stop in blocks:
        rows, valid = blocks.select(indices, start, stop)
        k_sel = _gather(k_flat, rows, (batch, stop - start, blocks.width, groups, dk))
        scores = _block_scores(q[:, start:stop].float().view(batch, stop - start, groups, heads // groups, dk),
                               k_sel, valid, scale)
        any_key = valid.any(-1)[:, :, None, None, None]
        summed[:, start:stop] = (torch.softmax(scores.masked_fill(~any_key, 0.0), dim=-1) * any_key).sum(dim=(2, 3))
    return summed


def absorb_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor,
               kv_b_weight: torch.Tensor, v_head_dim: int) -> tuple[torch.Tensor, ...]:
    """MLA's absorbed form for :func:`sparse_attention`: ``(q, k, v, w_uv)`` with one shared latent key/value head.

    ``q_nope`` ``[B, S, H, dn]``, ``q_rope`` ``[B, S, H, dr]`` (RoPE applied), ``kv_latent`` ``[B, T, C]`` (after
    ``kv_a_layernorm``), ``k_rope`` ``[B, T, dr]`` (RoPE applied), ``kv_b_weight`` ``[H * (dn + dv), C]`` (rows per head
    ``[k_nope, v]``, transformers' ``kv_b_proj.weight`` / megatron's ``linear_kv_up_proj.weight``). The query
    becomes ``[q_nope W_uk, q_rope]`` ``[B, S, H, C + dr]``, the key ``[kv_latent, k_rope]`` ``[B, T, 1, C + dr]`` and
    the value ``kv_latent`` ``[B, T, 1, C]``; the attention output ``o`` ``[B, S, H, C]`` maps to the expanded
    form's ``[B, S, H, dv]`` by ``einsum("bshc,hvc->bshv", o, w_uv)``. Scores and softmax are those of the expanded
    form (same scale), so the result equals it within rounding."""
    heads, dn = q_nope.shape[2], q_nope.shape[3]
    weight = kv_b_weight.view(heads, dn + v_head_dim, -1)
    w_uk, w_uv = weight[:, :dn], weight[:, dn:]  # [H, dn, C], [H, dv, C]
    q = torch.cat((torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_rope), dim=-1)
    k = torch.cat((kv_latent, k_rope), dim=-1).unsqueeze(2)
    return q, k, kv_latent.unsqueeze(2), w_uv
