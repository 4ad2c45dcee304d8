"""The lightning indexer's training loss: KL divergence to the main attention's distribution.

DeepSeek-V3.2 technical report (DeepSeek-V3.2-Exp, Sec. 2.1 "Continued Pre-Training"). For query token ``t`` the
main attention's probabilities are summed over its heads and L1-normalised along the keys, giving the target
``p[t, :]``; ``I[t, :]`` are the indexer's scores (:mod:`.indexer`).

- Dense warm-up (Eq. 3): ``L_I = sum_t KL(p[t, :] || softmax(I[t, :]))`` over the causal keys of ``t``, with
  dense attention and every parameter but the indexer's frozen.
- Sparse training (Eq. 4): ``L_I = sum_t KL(p[t, S_t] || softmax(I[t, S_t]))`` with
  ``S_t = {s : I[t, s] in top-k(I[t, :])}``: both distributions restricted to the selected tokens. Here, as in
  megatron-core's ``compute_dsa_indexer_loss``, ``p[t, S_t]`` is the sparse attention the model actually runs --
  each head's softmax over ``S_t``, summed over heads, L1-normalised.

``KL(p || q) = sum_s p_s (log p_s - log q_s)`` (``0 log 0 = 0``), averaged over the batch's query tokens (the
report writes the sum; the mean keeps the scale independent of the sequence length, as megatron does); the
coefficient is applied by the caller. The target is detached: the indexer learns only from ``L_I``, and (with the
indexer's inputs detached too) the main model only from the language-modelling loss.

:func:`indexer_kl_loss_reference` materialises ``[B, H, S, T]``; :func:`indexer_kl_loss` works on query blocks --
the sparse loss over the ``K`` selected keys only (a custom autograd function gathers the indexer keys per block
and adds their gradients back), the dense loss ``[block, heads, T]`` at a time under activation checkpointing --
and equals it within fp32 rounding, loss and gradients. :func:`attach_indexer_loss` hooks the loss into the
backward pass of the attention output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loongforge.models.sparse_attention.indexer import _positions, default_block
from loongforge.models.sparse_attention.sparse_attention import QueryBlocks, sparse_head_sum, topk_mask


def _kl_rows(target: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``KL(target / |target|_1 || softmax(logits))`` per row over the ``allowed`` entries (rows with none: 0)."""
    any_allowed = allowed.any(-1, keepdim=True)
    logits = logits.masked_fill(~allowed & any_allowed, float("-inf")).masked_fill(~any_allowed, 0.0)
    log_q = torch.log_softmax(logits.float(), dim=-1).masked_fill(~allowed, 0.0)
    p = target.float().masked_fill(~allowed, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)


def _head_summed_probs(scores: torch.Tensor, allowed: torch.Tensor, head_dims: tuple[int, ...]) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` (``-inf`` where not ``allowed``), summed over ``head_dims``."""
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).sum(dim=head_dims)


def indexer_kl_loss_reference(index_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float,
                              topk_indices: torch.Tensor | None = None,
                              query_offset: int | None = None) -> torch.Tensor:
    """Eq. 3 (``topk_indices`` None) or Eq. 4 from the dense ``[B, S, T]`` indexer scores and the main attention's
    queries ``q`` ``[B, S, H, Dk]`` and keys ``k`` ``[B, T, G, Dk]`` (detached here), materialising everything."""
    batch, seq, heads, _ = q.shape
    keys, groups = k.shape[1], k.shape[2]
    positions = _positions(seq, keys, query_offset, q.device)
    allowed = torch.arange(keys, device=q.device) <= positions[:, None]  # [S, T]
    if topk_indices is not None:
        allowed = allowed & topk_mask(topk_indices, keys, query_offset)  # [B, S, T]
    allowed = allowed.expand(batch, seq, keys)
    with torch.no_grad():
        qh = q.detach().float().transpose(1, 2)
        kh = k.detach().float().repeat_interleave(heads // groups, dim=2).transpose(1, 2)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, H, S, T]
        target = _head_summed_probs(scores, allowed.unsqueeze(1), (1,))
    return _kl_rows(target, index_scores, allowed).mean()


class _GatheredIndexScores(torch.autograd.Function):
    """``I[b, s, j] = sum_h w[b, s, h] ReLU(q[b, s, h] . k[b, indices[b, s, j]])`` (``-inf`` at unusable slots),
    blockwise; backward recomputes each block and ``index_add_``s the key gradients."""

    @staticmethod
    def forward(ctx, iq, ik, w, indices, query_offset, block_size):
        batch, seq, heads, dim = iq.shape
        blocks = QueryBlocks(indices, ik.shape[1], indices.shape[-1] * (dim + 3 * heads), query_offset, block_size)
        ik_flat = ik.reshape(-1, dim)
        out = torch.empty(indices.shape, dtype=torch.float32, device=iq.device)
        for start, stop in blocks:
            rows, valid = blocks.select(indices, start, stop)
            k_sel = ik_flat.index_select(0, rows.reshape(-1)).view(batch, stop - start, -1, dim).float()
            dots = torch.einsum("bnhd,bnkd->bnhk", iq[:, start:stop].float(), k_sel)
            scores = torch.einsum("bnhk,bnh->bnk", F.relu(dots), w[:, start:stop].float())
            out[:, start:stop] = scores.masked_fill(~valid, float("-inf"))
        ctx.save_for_backward(iq, ik, w, indices)
        ctx.args = (query_offset, block_size)
        return out

    @staticmethod
    def backward(ctx, grad):
        iq, ik, w, indices = ctx.saved_tensors
        query_offset, block_size = ctx.args
        batch, seq, heads, dim = iq.shape
        blocks = QueryBlocks(indices, ik.shape[1], indices.shape[-1] * (dim + 3 * heads), query_offset, block_size)
        ik_flat = ik.reshape(-1, dim)
        d_iq = torch.empty(iq.shape, dtype=torch.float32, device=iq.device)
        d_w = torch.empty(w.shape, dtype=torch.float32, device=iq.device)
        d_ik = torch.zeros(ik_flat.shape, dtype=torch.float32, device=iq.device)
        for start, stop in blocks:
            rows, valid = blocks.select(indices, start, stop)
            k_sel = ik_flat.index_select(0, rows.reshape(-1)).view(batch, stop - start, -1, dim).float()
            q_blk = iq[:, start:stop].float()
            dots = torch.einsum("bnhd,bnkd->bnhk", q_blk, k_sel)
            g = grad[:, start:stop].float().masked_fill(~valid, 0.0)
            d_w[:, start:stop] = torch.einsum("bnk,bnhk->bnh", g, F.relu(dots))
            d_dots = g[:, :, None, :] * w[:, start:stop].float()[..., None] * (dots > 0)
            d_iq[:, start:stop] = torch.einsum("bnhk,bnkd->bnhd", d_dots, k_sel)
            d_ik.index_add_(0, rows.reshape(-1), torch.einsum("bnhk,bnhd->bnkd", d_dots, q_blk).reshape(-1, dim))
        return d_iq.to(iq.dtype), d_ik.view(ik.shape).to(ik.dtype), d_w.to(w.dtype), None, None, None


def gathered_index_scores(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor,
                          indices: torch.Tensor, *, query_offset: int | None = None,
                          block_size: int | None = None) -> torch.Tensor:
    """The indexer scores at the selected slots, ``[B, S, K]`` fp32, ``-inf`` at unusable slots; differentiable in
    the indexer's queries ``[B, S, H, D]``, keys ``[B, T, D]`` and weights ``[B, S, H]``."""
    return _GatheredIndexScores.apply(index_q, index_k, index_weights, indices, query_offset, block_size)


def _dense_block(iq, ik, w, q, k, positions, scale):
    """Sum over one query block of the dense KL terms (Eq. 3); ``ik``/``k`` hold the block's causal keys only."""
    batch, n, heads, dim = iq.shape
    span, groups = k.shape[1], k.shape[2]
    per_head = F.relu(torch.bmm(iq.float().reshape(batch, n * heads, dim), ik.float().transpose(1, 2)))
    logits = torch.matmul(w.float().unsqueeze(-2), per_head.view(batch, n, heads, span)).squeeze(-2)
    allowed = torch.arange(span, device=iq.device) <= positions[:, None]  # [n, span]
    with torch.no_grad():
        q_heads = q.float().view(batch, n, groups, q.shape[2] // groups, q.shape[-1])
        scores = torch.einsum("bngrd,btgd->bngrt", q_heads, k.float()) * scale
        target = _head_summed_probs(scores, allowed[None, :, None, None, :], (2, 3))
    return _kl_rows(target, logits, allowed.expand(batch, n, span)).sum()


def indexer_kl_loss(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, scale: float, topk_indices: torch.Tensor | None = None, *,
                    attention_head_sum: torch.Tensor | None = None, query_offset: int | None = None,
                    block_size: int | None = None) -> torch.Tensor:
    """Eq. 3 (``topk_indices`` None: dense warm-up) or Eq. 4 (sparse), never holding ``[S, T]``.

    ``index_q``/``index_k``/``index_weights`` are :class:`~.indexer.IndexerProjections` (the gradient flows into
    them); ``q`` ``[B, S, H, Dk]`` and ``k`` ``[B, T, G, Dk]`` the main attention's (detached here) with softmax
    ``scale``. For Eq. 4, ``attention_head_sum`` may pass what :func:`~.sparse_attention.sparse_attention`
    returned with ``return_head_sum`` (else it is recomputed). Equals :func:`indexer_kl_loss_reference` given
    ``index_scores_reference(index_q, index_k, index_weights)``."""
    batch, seq = q.shape[:2]
    q, k = q.detach(), k.detach()
    if topk_indices is not None:
        logits = gathered_index_scores(index_q, index_k, index_weights, topk_indices, query_offset=query_offset,
                                       block_size=block_size)
        if attention_head_sum is None:
            attention_head_sum = sparse_head_sum(q, k, topk_indices, scale, query_offset=query_offset,
                                                 block_size=block_size)
        positions = _positions(seq, k.shape[1], query_offset, q.device)
        valid = (topk_indices >= 0) & (topk_indices <= positions[:, None])
        return _kl_rows(attention_head_sum, logits, valid).sum() / (batch * seq)
    keys = k.shape[1]
    positions = _positions(seq, keys, query_offset, q.device)
    block = block_size or default_block(batch, 2 * max(index_q.shape[2], q.shape[2]), keys)
    total = index_q.new_zeros((), dtype=torch.float32)
    for start in range(0, seq, block):
        stop = min(seq, start + block)
        span = int(positions[stop - 1]) + 1
        args = (index_q[:, start:stop], index_k[:, :span], index_weights[:, start:stop], q[:, start:stop],
                k[:, :span], positions[start:stop], scale)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in args[:3])
        total = total + (checkpoint(_dense_block, *args, use_reentrant=False) if needs_grad else _dense_block(*args))
    return total / (batch * seq)


class _AttachLoss(torch.autograd.Function):
    """Identity on the attention output whose backward also starts the indexer loss's backward (gradient
    ``backward_scale``), so the loss needs no path to the model's final loss."""

    backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, output, loss):
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, _AttachLoss.backward_scale)


def attach_indexer_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged; its backward also back-propagates ``loss`` (times :func:`set_indexer_loss_scale`'s
    value, 1 by default: set it to what the main loss's gradient is scaled by, e.g. ``1 / num_microbatches``).
    The result requires grad whenever ``loss`` does, so this works with the main model frozen (dense warm-up)."""
    return _AttachLoss.apply(output, loss)


def set_indexer_loss_scale(scale: float) -> None:
    """Scale of the gradient :func:`attach_indexer_loss` feeds into the indexer loss (process-wide)."""
    _AttachLoss.backward_scale = float(scale)
