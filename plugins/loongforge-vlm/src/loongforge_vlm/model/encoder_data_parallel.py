"""Heterogeneous data parallelism: the decoder's tensor-parallel ranks share out a micro-batch's images.

Why: the decoder's TP ranks all receive the same micro-batch, and a replicated encoder would encode every image on
every one of them -- ``tp`` times the vision compute for one result. With ``model.encoder.data_parallel_over_tp``
each TP rank encodes only its share of the images (whole images, balanced by patch count), and one all-gather over
the TP group puts every image's features back in the original order before they are written into the text.

Gradients: the all-gather's adjoint is a reduce-scatter -- each rank receives the sum over the group of the
gradients of its own images' features. The decoder's input gradient is the same on every TP rank (megatron
all-reduces it through the column-parallel layers), so that sum is ``tp`` times the true gradient, and the encoder's
parameter gradients, each from different images, are ``tp`` times each rank's share. The encoder's parameters carry
megatron's ``average_gradients_across_tp_domain``, so ``finalize_model_grads`` averages them over the TP group:
``(1/tp) * sum_r tp * share_r`` is exactly the one-process gradient, and the parameters stay equal on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def balanced_split(costs: list[int], ranks: int) -> list[list[int]]:
    """Item indices per rank: largest item first to the least loaded rank (ties: the lower rank), each rank's list
    in the original order. Deterministic, so every rank computes the same plan from the same batch."""
    loads = [0] * ranks
    plan: list[list[int]] = [[] for _ in range(ranks)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        loads[rank] += costs[item]
        plan[rank].append(item)
    return [sorted(items) for items in plan]


class _GatherRows(torch.autograd.Function):
    """Concatenate every rank's ``(rows_r, width)`` tensor, rank by rank; backward: the sum over the group of the
    incoming gradient, this rank's rows of it (the adjoint of an all-gather, a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rows: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        padded = local.new_zeros(max(rows), local.shape[1])  # all_gather wants equal shapes
        padded[:local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, rows, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.rows[:ctx.rank])
        return grad[start:start + ctx.rows[ctx.rank]], None, None, None


@dataclass(frozen=True)
class EncoderDataParallel:
    """The group whose ranks share out the images (the decoder's TP group) and this rank's place in it."""

    group: Any
    rank: int
    size: int

    def encode(self, encode: Callable[[list[int]], tuple[torch.Tensor, list[torch.Tensor]]], costs: list[int],
               tokens: list[int], *, width: int, levels: int, dtype: torch.dtype, requires_grad: bool
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every item's tokens ``(sum tokens, width)`` and DeepStack levels, in item order, from ``encode`` run on
        this rank's share only. ``encode(items)`` encodes the listed items (in that order) as the model would all
        of them; ``costs`` (patches) balance the share, ``tokens`` are each item's output rows, ``levels`` the
        feature sets per token (1 + DeepStack levels). ``requires_grad``: whether the encoder trains, the same on
        every rank (a rank without items must then still join the backward's collective)."""
        plan = balanced_split(costs, self.size)
        mine = plan[self.rank]
        if mine:
            merged, deepstack = encode(mine)
            local = torch.cat([merged, *deepstack], dim=-1)
        else:  # fewer items than ranks: this rank only takes part in the collective
            local = torch.zeros(0, width * levels, dtype=dtype, requires_grad=requires_grad)
        rows = [sum(tokens[i] for i in items) for items in plan]
        gathered = _GatherRows.apply(local, rows, self.rank, self.group)
        by_item = dict(zip([i for items in plan for i in items], gathered.split([tokens[i] for items in plan
                                                                                  for i in items]), strict=True))
        ordered = torch.cat([by_item[i] for i in range(len(costs))])
        merged, *deepstack = ordered.split(width, dim=-1)
        return merged, deepstack


def average_over_tp(*modules: nn.Module | None) -> None:
    """Mark the parameters of ``modules`` for megatron's ``finalize_model_grads`` to average over the TP group."""
    for module in modules:
        if module is not None:
            for param in module.parameters():
                param.average_gradients_across_tp_domain = True
