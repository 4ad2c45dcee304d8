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
