"""Megatron layer specs for a Llama-style decoder, built from a device backend's ``BackendSpecProvider``.

Megatron's own spec helpers hard-code their provider (``get_gpt_layer_local_spec`` always uses
``LocalSpecProvider``), so a device plugin could not swap in its attention or norm. These functions take the
provider from the selected backend, and handle both providers that fuse the norm into the following linear
(Transformer Engine) and those that do not.
"""

from __future__ import annotations

from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def decoder_layer_spec(provider: Any, *, qk_layernorm: bool, num_experts: int | None = None) -> ModuleSpec:
    """One pre-norm decoder layer: norm -> self-attention -> residual, norm -> (Swi)GLU MLP -> residual.

    With ``num_experts`` the MLP is megatron's ``MoELayer`` (router, token dispatcher, experts) with the
    provider's expert modules (on CPU: ``SequentialMLP`` of local linears; the norm is never fused into an MoE
    layer, so the pre-MLP norm stays a separate module and keeps its own checkpoint name).

    With a non-fused provider the checkpoint key map stores the norms under the fused (Transformer Engine)
    names, so dist-checkpoints move between the CPU and CUDA backends.
    """
    fused = provider.fuse_layernorm_and_linear()
    norm = provider.layer_norm(rms_norm=True, for_qk=False)
    qk_norm = provider.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp
    linear_qkv = provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused else norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused and num_experts is None else norm,
            mlp=get_mlp_module_spec_for_backend(backend=provider, num_experts=num_experts),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=(
                {}
                if fused
                else {
                    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    **({} if num_experts else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}),
                }
            ),
        ),
    )


def decoder_block_spec(
    provider: Any, config: TransformerConfig, *, qk_layernorm: bool, vp_stage: int | None = None,
    num_experts: int | None = None,
) -> TransformerBlockSubmodules:
    """The layers this pipeline stage (and virtual stage ``vp_stage``) builds plus the final norm."""
    layer = decoder_layer_spec(provider, qk_layernorm=qk_layernorm, num_experts=num_experts)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=provider.layer_norm(rms_norm=True, for_qk=False)
    )
