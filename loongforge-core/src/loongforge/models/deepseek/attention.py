"""Megatron's ``MLASelfAttention`` with the rotated key's gradient summed over tensor-parallel ranks.

The bug this fixes (megatron-core 0.16, ``MLASelfAttention.get_query_key_value_tensors``): with a column-parallel
``linear_kv_down_proj`` (megatron's own local MLA spec, and every provider here) at tp > 1, megatron gathers the
latent ``[kv_latent, k_rope]`` over the tensor-parallel ranks and then uses the rotated key ``k_rope`` -- shared
by *all* heads -- in each rank's own heads. Its gradient is therefore a sum over the ranks' heads, but the gather's
backward only slices each rank's columns out of its *own* partial gradient: the other ranks' heads' contribution to
``k_rope`` is dropped, and ``linear_kv_down_proj``'s rotated rows and the layer input get wrong gradients (at tp=2
on the tiny flavor the weight gradient is off by 23, the input gradient by 5; the forward is right). The latent part
is unaffected (its up-projection's input region sums over ranks).

:class:`DeepSeekMLA` turns the down-projection's output into what megatron's other branch expects -- the whole latent
on this rank's tokens, as a replicated linear would give -- with the crossings that make the backward right:
gathered over the ranks' columns, then with sequence parallelism scattered back to this rank's tokens (megatron then
all-gathers ``k_rope`` over the sequence, whose backward reduce-scatter sums the ranks' heads), and without it the
rotated columns passed through :class:`_SumGradOverRanks` (backward: all-reduce; not megatron's copy-to region,
whose ``_reduce`` all-reduces ``grad.contiguous()`` and so silently nothing when the gradient is a column slice, as
it is here). Forward values are unchanged; ``tests/core/test_deepseek_v3_parallel.py`` checks the gradients at tp=2
against one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group`` (made contiguous first, so it is reduced)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class DeepSeekMLA(MLASelfAttention):
    """``MLASelfAttention`` whose key/value down-projection hands megatron the whole latent (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.linear_kv_down_proj.register_forward_hook(self._whole_latent)

    def _whole_latent(self, module: Any, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        latent, bias = output
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if latent.size(-1) == width:  # already whole (one rank, or a replicated linear): megatron's path is right
            return output
        latent = gather_from_tensor_model_parallel_region(latent, group=self.tp_group)
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(latent, group=self.tp_group), bias
        rank = self.config.kv_lora_rank
        rope = _SumGradOverRanks.apply(latent[..., rank:], self.tp_group)
        return torch.cat([latent[..., :rank], rope], dim=-1), bias
