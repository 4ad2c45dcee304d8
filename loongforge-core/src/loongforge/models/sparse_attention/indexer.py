"""DeepSeek-V3.2's lightning indexer: which ``top-k`` earlier tokens each query attends to.

The math is transformers' ``DeepseekV32Indexer`` (itself DeepSeek's ``inference/model.py`` without the Hadamard
rotation, which preserves dot products, and without FP8 scoring)::

    q[s, h]   = RoPE(wq_b(q_resid[s]))[h]                   q_resid: MLA's q-LoRA latent after q_a_layernorm
    k[t]      = RoPE(LayerNorm(wk(hidden[t])))               one key head, shared by the indexer heads
    w[s, h]   = weights_proj(hidden[s])[h] * n_heads^-1/2
    I[s, t]   = sum_h w[s, h] * ReLU(q[s, h] . k[t] * head_dim^-1/2)      (-inf where t > s: causal)
    topk[s]   = the min(index_topk, T) keys with the largest I[s, :]

RoPE here is the half-split (``rotate_half``, not interleaved) rotation of the *first* ``rope_dim`` channels of
every indexer head; the rest pass through. (Megatron-core 0.16's ``DSAIndexer`` puts the rotated channels last and
de-interleaves them like MLA's; transformers and DeepSeek's reference put them first, half-split, as here.)

``softmax_scale`` is folded into ``w`` (``ReLU(c x) = c ReLU(x)`` for ``c > 0``), so :meth:`LightningIndexer.project`
returns ``w[s, h] = weights_proj(hidden)[h] * n_heads^-1/2 * head_dim^-1/2`` and scores are
``sum_h w * ReLU(q . k)``.

Selection: :func:`select_topk` works on blocks of queries (``[block, heads, keys]`` at a time, only the causal keys
of the block), so ``[seq x seq]`` is never held; :func:`index_scores_reference` + :func:`select_topk_reference`
compute the full score matrix as transformers does. Slots with no causal key to fill -- query ``s`` has only
``s + 1`` keys, fewer than ``top-k`` early in the sequence -- hold ``-1`` (transformers leaves arbitrary future
indices there that the causal mask then removes). So when ``seq <= top-k`` every query selects every earlier token
and sparse attention is exactly dense causal attention. The selection has no gradient; the indexer's parameters
learn only from its KL loss (:mod:`loongforge.models.sparse_attention.losses`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class IndexerProjections(NamedTuple):
    """The indexer's per-token tensors (fp32): queries ``[B, S, H, D]``, keys ``[B, T, D]``, head weights
    ``[B, S, H]`` (with ``n_heads^-1/2 * head_dim^-1/2`` folded in)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, base: float = 10000.0,
                 attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE tables for ``positions`` (any shape ``P``): ``cos``/``sin`` of shape ``[*P, rope_dim]``, laid out
    ``cat(freqs, freqs)`` as transformers' rotary embeddings return them (and times ``attention_scaling``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` half-split (``x * cos + rotate_half(x) * sin``);
    ``cos``/``sin`` broadcast against ``x[..., :rope_dim]``."""
    rope_dim = cos.shape[-1]
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    half = rope_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def _positions(seq: int, keys: int, query_offset: int | None, device: torch.device) -> torch.Tensor:
    """Absolute positions of the ``seq`` queries among ``keys`` keys (bottom-right aligned by default)."""
    offset = keys - seq if query_offset is None else query_offset
    if offset < 0:
        raise ValueError(f"{seq} queries after offset {offset} do not fit {keys} keys")
    return torch.arange(offset, offset + seq, device=device)


def index_scores_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                           query_offset: int | None = None) -> torch.Tensor:
    """Dense index scores ``[B, S, T]`` (fp32, differentiable), ``-inf`` above the causal diagonal: the whole
    ``[B, S, H, T]`` per-head matrix, as transformers computes it."""
    per_head = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)))  # [B, S, H, T]
    scores = torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)
    positions = _positions(q.shape[1], k.shape[1], query_offset, q.device)
    future = torch.arange(k.shape[1], device=q.device) > positions[:, None]
    return scores.masked_fill(future, float("-inf"))


def select_topk_reference(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``[B, S, min(topk, T)]`` indices of the largest ``scores`` per row, ``-1`` where the score is ``-inf``."""
    values, indices = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return indices.masked_fill(values == float("-inf"), -1)


#: fp32 elements of one query block's transient tensors (16 MiB): below glibc's largest mmap threshold, so blocks
#: reuse heap memory instead of faulting in fresh pages every time (see :mod:`loongforge.devices.cpu_malloc`).
BLOCK_ELEMENTS = 1 << 22


def default_block(batch: int, heads: int, keys: int, budget: int = BLOCK_ELEMENTS) -> int:
    """Queries per block so that one ``[batch, block, heads, keys]`` fp32 block stays under ``budget`` elements."""
    return max(1, min(keys, budget // max(1, batch * heads * keys)))


@torch.no_grad()
def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                query_offset: int | None = None, block_size: int | None = None) -> torch.Tensor:
    """The indexer's top-k keys per query, ``[B, S, min(topk, T)]`` int64, ``-1`` in slots with no causal key.

    Blocks of queries at a time, each scored only against the keys up to its last position: memory
    ``O(block * heads * T)``, never ``[S, T]``. Equal to ``select_topk_reference(index_scores_reference(...))``
    up to the order within a row (and ties)."""
    batch, seq, heads, dim = q.shape
    keys = k.shape[1]
    positions = _positions(seq, keys, query_offset, q.device)
    width = min(topk, keys)
    out = torch.full((batch, seq, width), -1, dtype=torch.long, device=q.device)
    block = block_size or default_block(batch, heads, keys)
    k_t = k.float().transpose(1, 2)  # [B, D, T]
    for start in range(0, seq, block):
        stop = min(seq, start + block)
        span = int(positions[stop - 1]) + 1  # keys the block can see
        q_blk = q[:, start:stop].float().reshape(batch, (stop - start) * heads, dim)
        per_head = F.relu(torch.bmm(q_blk, k_t[:, :, :span])).view(batch, stop - start, heads, span)
        scores = torch.matmul(weights[:, start:stop].float().unsqueeze(-2), per_head).squeeze(-2)
        future = torch.arange(span, device=q.device) > positions[start:stop, None]
        scores.masked_fill_(future, float("-inf"))
        values, indices = scores.topk(min(width, span), dim=-1)
        out[:, start:stop, : indices.shape[-1]] = indices.masked_fill(values == float("-inf"), -1)
    return out


class LightningIndexer(nn.Module):
    """The DSA lightning indexer, parameter names and shapes as transformers' ``DeepseekV32Indexer`` (``wq_b``,
    ``wk``, ``k_norm``, ``weights_proj``), so its state dict loads as is.

    :meth:`project` gives the (differentiable) queries, keys and head weights; :meth:`forward` the top-k indices
    (no gradient). ``cos``/``sin`` are the main attention's RoPE tables for the ``rope_dim`` rotary channels
    (``[S, rope_dim]`` or ``[B, S, rope_dim]``, ``cat(freqs, freqs)`` layout, any YaRN scaling already applied).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 norm_eps: float = 1e-6, block_size: int | None = None) -> None:
        super().__init__()
        if rope_dim > head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim {rope_dim} must be even and at most head_dim {head_dim}")
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.block_size = block_size
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=norm_eps)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    @classmethod
    def from_hf_config(cls, config, **kwargs) -> LightningIndexer:
        """From a transformers ``DeepseekV32Config`` (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""
        return cls(config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
                   config.qk_rope_head_dim, config.index_topk, **kwargs)

    def project(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> IndexerProjections:
        """Queries ``[B, S, H, D]``, keys ``[B, S, D]`` and weights ``[B, S, H]`` (fp32) for ``hidden_states``
        ``[B, S, hidden]`` and the q-LoRA latent ``q_resid`` ``[B, S, q_lora_rank]``."""
        batch, seq, _ = hidden_states.shape
        q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
        q = apply_rope_first(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        k = apply_rope_first(self.k_norm(self.wk(hidden_states)), cos, sin)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        weights = weights * (self.n_heads**-0.5 * self.softmax_scale)
        return IndexerProjections(q.float(), k.float(), weights)

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Top-k key indices ``[B, S, min(topk, S)]`` (``-1`` = no key), never holding ``[S, S]``."""
        with torch.no_grad():
            proj = self.project(hidden_states, q_resid, cos, sin)
        return select_topk(proj.q, proj.k, proj.weights, self.topk, block_size=self.block_size)
