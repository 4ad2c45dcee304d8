"""TAOT inside megatron-core's ``MoELayer``: the router and experts stay, dispatch/compute/combine are ours.

Why a subclass swapped onto the built layer (``layer.__class__ = ReplicatedMoELayer``) rather than a wrapper
module: the layer keeps its parameters, their names (checkpoints and HF conversion are unchanged), its
``sharded_state_dict``, the router hooks of ``MoEStats`` and every ``isinstance(..., MoELayer)`` check in
megatron; only ``forward`` changes. The router runs as before (aux loss included); the routed experts' weights
(``SequentialMLP`` of local SwiGLU MLPs) are read directly and applied by :func:`replicated_experts`.

Layers the replicated path cannot reproduce exactly are refused with the reason (:func:`why_not_replicable`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from loongforge_balance.taot.layer import ReplicaSettings, replicated_experts
from loongforge_balance.taot.planner import ReplicaPlan


def why_not_replicable(layer: MoELayer) -> str | None:
    """The reason this megatron MoE layer cannot take replicas, or None when it can."""
    if not isinstance(layer.experts, SequentialMLP):
        return f"its experts are {type(layer.experts).__name__}; TAOT needs SequentialMLP (moe_grouped_gemm off)"
    config = layer.config
    if layer.attn_tp_group.size() > 1 or (config.expert_tensor_parallel_size or 1) > 1:
        return "it uses tensor parallelism (tp or etp > 1); TAOT moves whole experts, so it needs tp=1 and etp=1"
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        return "its experts are not SwiGLU (gated_linear_unit with silu)"
    if config.add_bias_linear or config.glu_linear_offset or config.activation_func_clamp_value is not None:
        return "its experts have biases, a GLU offset or a clamped activation"
    if config.moe_expert_capacity_factor is not None:
        return "it drops tokens (moe_expert_capacity_factor is set)"
    if config.moe_latent_size or config.moe_apply_probs_on_input:
        return "it projects tokens to a latent size or applies router probabilities on the expert input"
    if layer.shared_expert_overlap or layer.moe_layer_recompute:
        return "it overlaps shared experts with the dispatch or recomputes the MoE layer (recompute_modules: moe)"
    if config.fp8 or config.fp4:
        return "it computes the experts in FP8/FP4"
    return None


class ReplicatedMoELayer(MoELayer):
    """A megatron ``MoELayer`` whose routed experts run through per-step TAOT replicas."""

    taot_settings: ReplicaSettings
    taot_last_plan: ReplicaPlan | None

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise NotImplementedError("TAOT replicas do not support partial CUDA-graph capture of the MoE layer")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        experts = self.experts.local_experts
        fc1 = torch.stack([expert.linear_fc1.weight for expert in experts])
        fc2 = torch.stack([expert.linear_fc2.weight for expert in experts])
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        output, plan = replicated_experts(tokens, probs, routing_map, fc1, fc2, self.taot_settings, self.ep_group)
        self.taot_last_plan = plan
        output = output.view(hidden_states.shape).to(hidden_states.dtype)
        if shared_output is not None:
            output = output + shared_output
        return output, None


def enable_replicas(layer: MoELayer, settings: ReplicaSettings) -> None:
    """Switch ``layer`` to the replicated forward in place; raises ``ValueError`` with the reason if it can't."""
    reason = why_not_replicable(layer)
    if reason:
        raise ValueError(reason)
    layer.__class__ = ReplicatedMoELayer
    layer.taot_settings = settings
    layer.taot_last_plan = None
