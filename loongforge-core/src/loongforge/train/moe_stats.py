"""Per-step MoE statistics: the load-balancing loss and how many tokens each expert received.

Why here and not from megatron's ``track_moe_metrics``: that function writes to its own TensorBoard/W&B
writers and allocates with ``device="cuda"``. We read the same tracker megatron's routers fill
(``load_balancing_loss`` per layer, summed over micro-batches) after its cross-rank reduction, and count
tokens with a forward hook on each router (the ``routing_map`` it returns, summed over tokens: one small
integer add per layer per micro-batch). The counts of all layers go through one all-reduce per step; they are
what expert-placement optimisations (TAOT) consume through ``Trainer.expert_tokens``: one row per decoder layer
(a dense layer's stays zero); the routers of multi-token-prediction blocks are not counted there, but their
load-balancing losses join the average as megatron's own logging does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


class MoEStats:
    """Hooks the routers of ``chunks`` (unwrapped or DDP-wrapped megatron modules) of an MoE model."""

    def __init__(self, chunks: list[Any], config: Any) -> None:
        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        # Without sequence parallelism the tensor-parallel ranks route the same tokens: count them once.
        self._counts_here = config.sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
        # megatron's process-wide MoE states (the tracker, the aux loss's backward scale) were reset when the model
        # was built (loongforge.models.decoder_model), so nothing an earlier model in this process left counts here.
        routers = 0
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    routers += 1
                    if not _in_mtp_block(name):
                        module.register_forward_hook(self._count)
        #: MoE layers of the whole model (every stage's, MTP blocks' too): what the aux loss is averaged over. Dense
        #: layers (DeepSeek's first, Qwen3-Next's ``mlp_only_layers``) add no loss and are not counted.
        self.num_moe_layers = _whole_model_count(routers)

    def _count(self, router: Any, inputs: Any, output: Any) -> None:
        _, routing_map = output
        self._counts[router.layer_number - 1] += routing_map.sum(dim=0).to(torch.int64)

    def collect(self, num_microbatches: int) -> tuple[float | None, list[list[int]]]:
        """``(aux loss, tokens per expert per layer)`` of the step just taken; resets both.

        The aux loss is megatron's logged value (the load-balancing loss before its coefficient), averaged over
        layers and micro-batches; ``None`` when the model has no aux loss.
        """
        counts = self._counts.clone() if self._counts_here else torch.zeros_like(self._counts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        self._counts.zero_()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        aux = None
        if "load_balancing_loss" in tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
            aux = tracker["load_balancing_loss"]["values"].sum().item() / num_microbatches / self.num_moe_layers
            moe_utils.clear_aux_losses_tracker()
        return aux, counts.tolist()

    def discard(self) -> None:
        """Forget what forward passes since the last :meth:`collect` counted (an evaluation's, which are not a
        step's): the token counts, and any losses the routers tracked."""
        self._counts.zero_()
        moe_utils.clear_aux_losses_tracker()


def _in_mtp_block(module_name: str) -> bool:
    """Whether a module of a megatron ``GPTModel`` (DDP-wrapped or not) sits in its multi-token-prediction block."""
    return "mtp" in module_name.split(".")


def _whole_model_count(local: int) -> int:
    """The sum of ``local`` over the pipeline stages: every rank of a stage holds the same modules (tensor, data,
    context and expert parallel ranks replicate the routers), so the world's sum counts each stage that often."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    total = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(total)
    copies = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
    return int(total.item()) // copies
