"""Tensor parallelism for the Wan DiT's blocks with torch DTensor: heads and FFN columns split over a ``tp`` mesh.

Megatron's split of a transformer block, written with ``torch.distributed.tensor.parallel.parallelize_module``:
projections into heads and FFN columns are column-parallel (``ColwiseParallel``: each rank computes its heads /
columns), projections back are row-parallel (``RowwiseParallel``: partial outputs summed by one all-reduce), so
each of a block's three sub-layers (self-attention, cross-attention, FFN) costs one all-reduce of the activations
forward and one backward, and every rank holds ``1/tp`` of the block's weights. Everything outside the blocks
(patch, time and text embeddings, head) stays replicated: it is small and each rank computes it alike. What Wan
adds to the textbook split:

* **Fused projections** (``self_attn.qkv``, ``cross_attn.kv``, ``cross_attn.kv_img``) hold ``[q; k; v]`` in one
  weight. A plain column split would hand rank 0 all of q and half of k, so each rank holds its heads' rows of every
  part, ``[q_r; k_r; v_r]``: the weight is a DTensor placed ``_StridedShard(0, split_factor=parts)`` (gathered, it is
  the unsplit weight again, so checkpoints keep their layout) and FSDP2 shards it along dim 1 instead
  (``loongforge.parallel.torch_native.shard_placement``). Its small bias stays a whole, replicated tensor that each
  rank slices (the slices' gradients are summed over the ranks).
* **q/k RMSNorm over the whole hidden dim.** Wan normalises q and k across all heads, but a rank holds ``dim/tp``
  of them. Two ways: gather q (``dim`` values per token), normalise, keep this rank's part; or a distributed RMS:
  all-reduce each token's sum of squares (one value per token) and normalise the local part by it. The second
  sends ``dim`` times less and is exact (the same sum, added in another order), so it is what
  :class:`TensorParallelRMSNorm` does; its weight is split with the heads.
* **Heads** divide by ``tp`` and, under Ulysses context parallelism, what is left by ``cp``: attention cuts heads by
  ``head_dim`` (:mod:`loongforge_diffusion.wan.attention`), so a rank's share of heads runs through the same code
  and the Ulysses exchange splits the rank's heads further over its context-parallel group.

Activation recompute (``task.recompute``) re-runs a block's collectives in its backward in the same order on every
rank, so it composes unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loongforge.errors import ConfigError
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from loongforge_diffusion.wan.block import WanBlock
from loongforge_diffusion.wan.model import WanModel


def _summed(x: torch.Tensor, group: Any) -> torch.Tensor:
    """A new tensor holding the sum of every rank's ``x``."""
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input's gradient over the group, because each rank's column
    projection contributes only its columns' share of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grad, ctx.group), None


class _SumOverTensorParallel(torch.autograd.Function):
    """The sum of every rank's value, on every rank; the backward sums the gradients the same way, because each
    rank's output feeds different computations (its own heads) and every rank's input reaches all of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grad, ctx.group), None


class FusedColumnParallelLinear(nn.Module):
    """A fused column-parallel projection (``parts`` projections in one weight): this rank's heads of each part.

    Keeps the replaced ``nn.Linear``'s parameter names (``weight``, ``bias``), so state dicts, checkpoints and
    optimizer state read as before."""

    def __init__(self, linear: nn.Linear, parts: int, mesh: Any) -> None:
        super().__init__()
        self.parts, self.group = parts, mesh.get_group()
        placement = _StridedShard(0, split_factor=parts)
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [placement]),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = linear.bias  # whole on every rank; sliced in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        # every rank uses its slices of the whole bias: summing the gradients over ranks fills in every slice
        bias = _CopyToTensorParallel.apply(self.bias, self.group).unflatten(0, (self.parts, size, -1))[:, rank]
        bias = bias.flatten()
        return F.linear(x, self.weight.to_local(), bias)


class TensorParallelRMSNorm(nn.Module):
    """RMSNorm over a hidden dim split across the group: ``x_r / sqrt(mean over all ranks' x**2 + eps) * w_r``, the
    sum of squares all-reduced (its gradient too: every rank's output depends on every rank's input)."""

    def __init__(self, norm: nn.RMSNorm, mesh: Any) -> None:
        super().__init__()
        self.group, self.eps, self.dim = mesh.get_group(), norm.eps, norm.normalized_shape[-1]
        self.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = _SumOverTensorParallel.apply(x.float().pow(2).sum(-1, keepdim=True), self.group)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return (x.float() * torch.rsqrt(squares / self.dim + eps)).type_as(x) * self.weight.to_local()


def check_tensor_parallel(flavor: Any, tp: int, cp: int, where: str) -> None:
    """Heads must split over ``tp`` and then ``cp`` ranks, the FFN's columns over ``tp``; one line naming the key."""
    if flavor.num_heads % (tp * cp):
        raise ConfigError(f"{where}: parallel.tp={tp} x parallel.cp={cp} must divide the model's num_heads "
                          f"({flavor.num_heads}): tensor parallelism splits heads, Ulysses splits each rank's share")
    if flavor.ffn_dim % tp:
        raise ConfigError(f"{where}: parallel.tp={tp} must divide the model's ffn_dim ({flavor.ffn_dim})")


def parallelize_wan(model: nn.Module, mesh: Any) -> None:
    """Split every :class:`WanBlock` of ``model`` (one DiT or both experts) over the 1-D ``mesh`` in place."""
    for block in [m for m in model.modules() if isinstance(m, WanBlock)]:
        parallelize_module(block, mesh, {"self_attn.out": RowwiseParallel(), "cross_attn.q": ColwiseParallel(),
                                         "cross_attn.out": RowwiseParallel(), "ffn.fc1": ColwiseParallel(),
                                         "ffn.fc2": RowwiseParallel()})
        attention, cross = block.self_attn, block.cross_attn
        attention.qkv = FusedColumnParallelLinear(attention.qkv, 3, mesh)
        cross.kv = FusedColumnParallelLinear(cross.kv, 2, mesh)
        if cross.kv_img is not None:
            cross.kv_img = FusedColumnParallelLinear(cross.kv_img, 2, mesh)
            cross.norm_k_img = TensorParallelRMSNorm(cross.norm_k_img, mesh)
        for owner in (attention, cross):
            owner.norm_q = TensorParallelRMSNorm(owner.norm_q, mesh)
            owner.norm_k = TensorParallelRMSNorm(owner.norm_k, mesh)
    for dit in (m for m in model.modules() if isinstance(m, WanModel)):
        dit.tensor_parallel = mesh.size()
