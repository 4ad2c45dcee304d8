"""Autograd-aware collectives for context parallelism over ``(batch, tokens, heads, head_dim)`` tensors.

Ulysses: an all-to-all trades "my shard of the tokens, all heads" for "all tokens, my ``heads / cp``" so that
each rank runs ordinary attention on whole sequences; the inverse exchange restores the token shards. Each
exchange is the other's gradient. gloo implements ``all_to_all_single`` with equal splits, so the same code
runs on CPU test groups and NCCL. (Core's ``loongforge.devices.ulysses`` does the same for megatron's
``[s, b, h, d]`` zig-zag layout; this one is for contiguous shards, batch first.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from loongforge.devices.ulysses import all_to_all_blocks


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``(B, s, H, D)`` (my tokens, all heads) -> ``(B, cp*s, H/cp, D)`` (all tokens in rank order, my heads)."""
    cp = dist.get_world_size(group)
    b, s, h, d = x.shape
    return all_to_all_blocks(x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4), group,
                             lambda received: received.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d))


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, S, h, D)`` -> ``(B, S/cp, cp*h, D)``."""
    cp = dist.get_world_size(group)
    b, total, h, d = x.shape
    return all_to_all_blocks(x.reshape(b, cp, total // cp, h, d).permute(1, 0, 2, 3, 4), group,
                             lambda received: received.permute(1, 2, 0, 3, 4).reshape(b, total // cp, cp * h, d))


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _Exchange.apply(x, group, False)


class _GatherTokens(torch.autograd.Function):
    """All shards along ``dim``, in rank order. The backward keeps this rank's slice of the gradient, which is
    right when every rank feeds the gathered tensor to the same computation (a replicated consumer): each rank
    then already holds the whole gradient, and summing it over ranks would count it ``cp`` times."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = group, dim, x.shape[dim]
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, x.contiguous(), group=group)
        return torch.cat(shards, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = dist.get_rank(ctx.group) * ctx.length
        return grad.narrow(ctx.dim, start, ctx.length), None, None


def gather_tokens(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    return _GatherTokens.apply(x, group, dim)


class _SumPartials(torch.autograd.Function):
    """Forward: the sum of every rank's partial value. Backward: the incoming gradient unchanged, because
    ``d(sum)/d(partial) = 1`` and every rank back-propagates the same total (an all-reduce of the gradient, as
    ``torch.distributed.nn.all_reduce`` does, would scale it by the group size)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_partials(partial: torch.Tensor, group: Any) -> torch.Tensor:
    return _SumPartials.apply(partial, group)


def all_reduce_gradients(module: torch.nn.Module, group: Any, scale: float = 1.0) -> None:
    """Sum parameter gradients over ``group`` (``None``: all ranks) in one collective, then multiply by ``scale``.

    Under context parallelism each rank's gradients are its tokens' share of the total (the exchanges route the
    other ranks' shares back during the backward), so the group's sum is the single-process gradient. With data
    parallelism on top, one all-ranks reduction with ``scale = 1 / data-parallel size`` sums over each context
    group and averages over the data shards at once.
    """
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))
