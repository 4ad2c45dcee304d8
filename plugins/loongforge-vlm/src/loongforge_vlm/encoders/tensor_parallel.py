"""Megatron tensor parallelism inside a vision tower: attention heads and MLP columns split over the TP ranks.

Why: a large ViT (Qwen2.5-VL-72B's is 670M parameters, InternViT-6B far more) replicated on every TP rank costs
its full weights, gradients, optimizer state and activations on each of them. Split like megatron splits the
decoder -- the fused ``qkv`` and ``fc1`` column-parallel (each rank its heads / hidden columns), ``out`` and
``fc2`` row-parallel (partial sums all-reduced) -- each rank holds ``1/tp`` of the blocks. The encoder uses the
decoder's TP group, so its tp equals the decoder's ``parallel.tp``.

The shards keep the full module's names (``qkv.weight``...), are cut from a fully built tower (so every layout starts
from the same weights as one process), carry megatron's tensor-parallel attributes (the optimizer's gradient norm
counts each shard once) and state their place in the full tensor for distributed checkpoints, so a checkpoint saved
at encoder tp 2 loads at tp 1 and back. A fused weight whose rows are blocks (``[q; k; v]``, SwiGLU's ``[gate;
up]``) holds each block's slice, and states each as its own piece, like megatron's SwiGLU ``linear_fc1``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn


class ColumnShard(nn.Linear):
    """This rank's output rows of a linear whose rows are ``blocks`` equal blocks, each split over the TP ranks;
    the input is replicated (its gradient all-reduced in the backward)."""

    def __init__(self, full: nn.Linear, blocks: int, rank: int, size: int) -> None:
        rows = full.out_features // blocks // size
        super().__init__(full.in_features, rows * blocks, bias=full.bias is not None, dtype=full.weight.dtype)
        self.blocks = blocks
        picked = [b * size * rows + rank * rows for b in range(blocks)]
        with torch.no_grad():
            self.weight.copy_(torch.cat([full.weight[p:p + rows] for p in picked]))
            if self.bias is not None:
                self.bias.copy_(torch.cat([full.bias[p:p + rows] for p in picked]))
        for param in self.parameters():
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(tensor_parallel.copy_to_tensor_model_parallel_region(x), self.weight, self.bias)


class RowShard(nn.Linear):
    """This rank's input columns of a linear; the partial products are summed over the TP ranks, then the
    (replicated) bias is added once."""

    def __init__(self, full: nn.Linear, rank: int, size: int) -> None:
        columns = full.in_features // size
        super().__init__(columns, full.out_features, bias=full.bias is not None, dtype=full.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(full.weight[:, rank * columns:(rank + 1) * columns])
            if self.bias is not None:
                self.bias.copy_(full.bias)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tensor_parallel.reduce_from_tensor_model_parallel_region(nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _block_pieces(blocks: int, offsets: tuple[Any, ...]) -> tuple[Any, Any]:
    """``build_fn`` and ``merge_fn`` of a ``ShardedTensorFactory`` for a weight (or bias) of ``blocks`` row blocks,
    each this rank's slice of its block: one placed piece per block."""
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()

    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[ShardedTensor]:
        return [ShardedTensor.from_rank_offsets(key, piece, *offsets, (len(offsets), b * size + rank, blocks * size),
                                                replica_id=replica_id, prepend_axis_num=len(offsets))
                for b, piece in enumerate(data.chunk(blocks))]

    def merge(pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pieces)

    return build, merge


def sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Megatron's sharded state of a tower with shards: replicated tensors as megatron states them for any plain
    module, a shard's tensors with their TP axis (a fused block weight as one piece per block)."""
    axes: dict[str, int] = {}
    fused: dict[str, int] = {}
    for name, child in module.named_modules():
        if isinstance(child, ColumnShard):
            for param in ("weight", "bias") if child.bias is not None else ("weight",):
                (fused if child.blocks > 1 else axes)[f"{name}.{param}"] = child.blocks if child.blocks > 1 else 0
        elif isinstance(child, RowShard):
            axes[f"{name}.weight"] = 1
    state = make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                sharded_offsets)
    for name, blocks in fused.items():
        entry = state[f"{prefix}{name}"]
        build, merge = _block_pieces(blocks, tuple(sharded_offsets))
        state[f"{prefix}{name}"] = ShardedTensorFactory(entry.key, entry.data, build, merge,
                                                        replica_id=(0, 0, entry.replica_id[2]))
    return state


def shard_heads_and_mlp(blocks: nn.ModuleList, size: int) -> None:
    """Split every block's ``attn`` (fused ``qkv``, ``out``, ``num_heads``) and ``mlp`` (``fc1`` -- two blocks when
    gated -- and ``fc2``) over ``size`` TP ranks, in place (``size`` divides the heads and the MLP width:
    :func:`loongforge_vlm.model.flavors.encoder_tp_problem`)."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv, attn.out = ColumnShard(attn.qkv, 3, rank, size), RowShard(attn.out, rank, size)
        attn.num_heads //= size
        mlp.fc1 = ColumnShard(mlp.fc1, 2 if mlp.gated else 1, rank, size)
        mlp.fc2 = RowShard(mlp.fc2, rank, size)
