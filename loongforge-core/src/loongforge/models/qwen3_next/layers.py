"""Qwen3-Next's layers as megatron specs, one per layer, from the device's spec provider: the
:class:`~loongforge.models.chunks.DecoderSpec` its flavor hands to ``ChunkBuild.decoder_chunk``.

Each layer starts as core's pre-norm decoder layer (:func:`loongforge.models.layer_spec.decoder_layer_spec`: QK-norm,
the MLP dense or megatron's ``MoELayer`` with its shared expert, the provider's norms and linears, fused
norm+linear where the provider fuses). A ``full_attention`` layer keeps megatron's ``SelfAttention``, gated through
megatron's ``attention_output_gate``; a ``linear_attention`` layer swaps it for the Gated DeltaNet mixer
(:class:`~loongforge.models.qwen3_next.mixer.GatedDeltaNet`) built from the same provider. Switches every layer reads
(the output gate, the shared expert's gate, the DeltaNet's sizes) travel in megatron's ``TransformerConfig``
(:func:`config_fields`); core sets the norm (zero-centred RMSNorm), RoPE, MoE routing and the rest from the flavor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from loongforge.models.decoder_model import DecoderSpec
from loongforge.models.layer_spec import decoder_layer_spec
from loongforge.models.qwen3_next.mixer import GatedDeltaNet, GatedDeltaNetSubmodules

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge.models.qwen3_next.flavors import Qwen3NextFlavor


class HybridLayer(TransformerLayer):
    """Megatron's layer, checkpointed under its own key with a one-layer axis.

    Layers of different kinds share no tensor names, so the block cannot stack them on one layer axis as it does
    identical layers; megatron's ``hetereogenous_dist_checkpoint`` (set in :func:`config_fields`) stores each under
    ``decoder.layers.<global index>.`` instead, with no layer axis. This layer adds back a layer axis of size one,
    so every sharded tensor keeps the ``[layer, (expert,) ...]`` axes that core's full-state tools read a global
    expert index from (:mod:`loongforge.interop.sharding`), and checkpoints stay independent of the pipeline layout.
    """

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        return super().sharded_state_dict(prefix, tuple(sharded_offsets) or ((0, 0, 1),), metadata)


def config_fields(flavor: Qwen3NextFlavor) -> dict[str, Any]:
    """The ``TransformerConfig`` fields Qwen3-Next's layers read beyond what core sets from a decoder flavor."""
    fields: dict[str, Any] = dict(
        hetereogenous_dist_checkpoint=True,  # sic: megatron's spelling
        attention_output_gate=flavor.attention_output_gate,
        linear_conv_kernel_dim=flavor.linear_conv_kernel_dim,
        linear_key_head_dim=flavor.linear_key_head_dim,
        linear_value_head_dim=flavor.linear_value_head_dim,
        linear_num_key_heads=flavor.linear_num_key_heads,
        linear_num_value_heads=flavor.linear_num_value_heads,
    )
    if flavor.num_experts is not None and flavor.moe_shared_expert_intermediate_size:
        fields["moe_shared_expert_gate"] = flavor.moe_shared_expert_gate
    return fields


def deltanet_layer(layer: ModuleSpec, provider: Any) -> ModuleSpec:
    """``layer`` (core's decoder layer spec) with Gated DeltaNet in place of self-attention.

    A provider that fuses the input norm into the following linear (Transformer Engine) gets it fused into
    ``in_proj``; otherwise the norm stays ``input_layernorm`` and checkpoints store it under the fused name, as core
    does for attention layers, so dist-checkpoints move between such providers.
    """
    fused = provider.fuse_layernorm_and_linear()
    mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear(),
        out_norm=provider.layer_norm(rms_norm=True, for_qk=False),
        out_proj=provider.row_parallel_linear(),
    ))
    submodules = layer.submodules
    keys = {k: v for k, v in submodules.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    if not fused:
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        submodules, self_attention=mixer, input_layernorm=IdentityOp if fused else submodules.input_layernorm,
        sharded_state_dict_keys_map=keys))


def layer_specs(provider: Any, config: TransformerConfig, *, flavor: Qwen3NextFlavor) -> list[ModuleSpec]:
    """One spec per layer of the whole model (core keeps this pipeline stage's)."""
    specs = []
    for index, kind in enumerate(flavor.layer_kinds):
        experts = flavor.num_experts if flavor.is_moe_layer(index) else None
        layer = decoder_layer_spec(provider, qk_layernorm=flavor.qk_layernorm, num_experts=experts)
        layer = dataclasses.replace(layer, module=HybridLayer)
        specs.append(deltanet_layer(layer, provider) if kind == "linear_attention" else layer)
    return specs


def decoder_spec(flavor: Qwen3NextFlavor) -> DecoderSpec:
    """What ``ChunkBuild.decoder_chunk`` needs beside the flavor: the per-layer specs and the config fields."""
    return DecoderSpec(layer_specs=functools.partial(layer_specs, flavor=flavor), config_fields=config_fields(flavor))
