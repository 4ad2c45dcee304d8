"""Fixed-seed skewed expert loads, to test and benchmark the replica planners.

Router statistics of MoE pre-training runs show a few experts receiving several times the mean, a
popularity that drifts slowly from step to step, and ranks whose data prefer somewhat different experts.
Hence: log-normal expert popularity, a Gaussian random walk on its logarithm between steps, per-rank noise
on top, and each rank's ``tokens_per_rank * topk`` routed pairs drawn from it (an expert's share is capped at
``1 / topk``: a token picks an expert at most once).
"""

from __future__ import annotations

import torch


def skewed_counts(steps: int, ranks: int, experts: int, *, tokens_per_rank: int = 4096, topk: int = 8,
                  skew: float = 1.0, drift: float = 0.1, rank_noise: float = 0.3, seed: int = 0) -> torch.Tensor:
    """``counts[step, source_rank, expert]``: (token, expert) pairs each rank routes to each expert."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.randn(experts, generator=gen, dtype=torch.float64) * skew
    out = torch.empty(steps, ranks, experts, dtype=torch.int64)
    for step in range(steps):
        logits = popularity + rank_noise * torch.randn(ranks, experts, generator=gen, dtype=torch.float64)
        share = torch.softmax(logits, dim=1)
        share = share.clamp(max=1.0 / topk)
        share = share / share.sum(dim=1, keepdim=True)
        pairs = torch.multinomial(share, tokens_per_rank * topk, replacement=True, generator=gen)
        out[step] = torch.zeros(ranks, experts, dtype=torch.int64).scatter_add_(1, pairs, torch.ones_like(pairs))
        popularity = popularity + drift * torch.randn(experts, generator=gen, dtype=torch.float64)
    return out
