"""Context parallelism in the training step: each rank's share of a micro-batch, and the loss over all shares.

Why these two pieces: megatron splits the *model's* work over the context-parallel group (RoPE slices its
table per rank, attention is ours: :mod:`loongforge.devices.ulysses`), but the data and the loss are the
trainer's. Every cp rank reads the same micro-batch and keeps chunks ``i`` and ``2*cp-1-i`` of ``2*cp``
(megatron's ``get_batch_on_this_cp_rank`` layout, which the RoPE slicing assumes). The loss must be the mean
over the tokens of *all* chunks: each rank divides its own token-loss sum by the global token count. megatron's
schedule then multiplies a ``(loss, reported)`` loss by cp and its DDP averages gradients over dp*cp, which
together leave exactly the gradient of the global mean (also with loss masks that differ between chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

#: Batch entries laid out ``[batch, sequence]`` that follow the sequence split.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def split_for_rank(batch: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """The part of ``batch`` context-parallel rank ``rank`` of ``size`` works on (chunks rank, 2*size-1-rank)."""
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism supports causal attention only (no explicit attention_mask)")
    part = dict(batch)
    index = torch.tensor([rank, 2 * size - 1 - rank])
    for key in SEQUENCE_KEYS:
        value = batch[key]
        b, s = value.shape[0], value.shape[1]
        part[key] = value.reshape(b, 2 * size, s // (2 * size)).index_select(1, index).reshape(b, -1)
    return part


def global_mean_loss(group: Any, loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """This rank's token-loss sum over the token count of all cp ranks; reports the global mean.

    The count and the reported sum cross the group detached: gradients flow only through the local sum.
    """
    mask = loss_mask.reshape(-1).float()
    local = torch.sum(per_token_loss.float().reshape(-1) * mask)
    totals = torch.stack([local.detach(), mask.sum()])
    dist.all_reduce(totals, group=group)
    count = totals[1].clamp(min=1)
    return local / count, {"loss": totals[0] / count}


def hybrid_groups(cp_groups: Sequence[Sequence[int]], a2a: int) -> tuple[Any, Any]:
    """Create the sub-groups of hybrid context parallelism for every cp group; return this rank's
    ``(a2a_group, ring_group)``.

    In a cp group of ranks ``c_0 < c_1 < ...`` (cp rank = position), the Ulysses sub-groups are ``a2a``
    consecutive cp ranks and each ring group takes one rank of every sub-group at the same position, in
    sub-group order -- the layout megatron's ``hierarchical_context_parallel_sizes=[a2a, cp/a2a]`` builds, which
    is what :func:`loongforge.devices.ring_attention.member_pieces` assumes. ``dist.new_group`` is collective:
    every rank must call this with the same ``cp_groups``.
    """
    rank, mine = dist.get_rank(), [None, None]
    for ranks in cp_groups:
        ranks = sorted(ranks)
        cp = len(ranks)
        for level, members in enumerate([[ranks[j * a2a:(j + 1) * a2a] for j in range(cp // a2a)],
                                          [ranks[u::a2a] for u in range(a2a)]]):
            for sub in members:
                group = dist.new_group(sub)
                if rank in sub:
                    mine[level] = group
    return mine[0], mine[1]
