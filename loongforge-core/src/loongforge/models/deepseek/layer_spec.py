"""Megatron layer specs of a DeepSeek decoder, every module from the device's spec provider.

Megatron's own MLA specs hard-code their provider (``get_gpt_layer_local_spec(multi_latent_attention=True)`` always
uses ``LocalSpecProvider``), so here each module comes from the ``provider`` core passes to
:class:`~loongforge.models.decoder_model.DecoderSpec.layer_specs`. The down-projections of MLA are the provider's
column-parallel linears on every backend (megatron gathers their output; a provider needs no ``linear()``); with
a provider that fuses norms into the next linear (Transformer Engine) the query/latent norms are fused into the
up-projections and a dense layer's pre-MLP norm into ``linear_fc1``, and without one the checkpoint key map stores
them under the fused names, so dist-checkpoints move between devices (as core's own layer spec does).

The MLA hyperparameters, YaRN, the router (sigmoid/softmax, groups, scaling, expert bias), the dense/MoE layer
pattern and multi-token prediction reach megatron as fields of its ``MLATransformerConfig``
(:func:`config_fields`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from loongforge.models.decoder_model import DecoderSpec
from loongforge.models.deepseek.attention import DeepSeekMLA

if TYPE_CHECKING:
    from loongforge.models.deepseek.flavor import DeepSeekFlavor


def config_fields(flavor: DeepSeekFlavor) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of ``flavor`` beyond what core's ``transformer_config`` sets."""
    fields: dict[str, Any] = dict(
        q_lora_rank=flavor.q_lora_rank, kv_lora_rank=flavor.kv_lora_rank, qk_head_dim=flavor.qk_nope_head_dim,
        qk_pos_emb_head_dim=flavor.qk_rope_head_dim, v_head_dim=flavor.v_head_dim, rotary_base=flavor.rope_theta,
        rotary_percent=1.0,
    )
    if flavor.yarn_factor is None:  # plain RoPE; megatron's softmax scale reads mscale_all_dim even then
        fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        fields.update(rope_type="yarn", rotary_scaling_factor=flavor.yarn_factor,
                      original_max_position_embeddings=flavor.yarn_original_max_position_embeddings,
                      beta_fast=flavor.yarn_beta_fast, beta_slow=flavor.yarn_beta_slow, mscale=flavor.yarn_mscale,
                      mscale_all_dim=flavor.yarn_mscale_all_dim)
    if flavor.is_moe:
        fields.update(
            moe_layer_freq=[int(moe) for moe in flavor.moe_layers],
            moe_router_score_function=flavor.moe_score_function,
            moe_router_enable_expert_bias=flavor.moe_expert_bias,
            moe_router_bias_update_rate=flavor.moe_bias_update_rate,
            moe_router_num_groups=flavor.moe_router_num_groups,
            moe_router_group_topk=flavor.moe_router_group_topk,
            moe_router_topk_scaling_factor=flavor.moe_routed_scaling_factor,
            # V3's sequence-wise balance loss where it has a coefficient; aux-loss-free (the bias alone) without
            moe_router_load_balancing_type=flavor.moe_aux_loss_type if flavor.moe_aux_loss_coeff else "none",
        )
    if flavor.mtp_num_layers:
        fields.update(mtp_num_layers=flavor.mtp_num_layers, mtp_loss_scaling_factor=flavor.mtp_loss_scaling_factor)
    if flavor.is_dsa:  # MLA hands its core attention the hidden states and the query latent (x, qr)
        fields.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=flavor.index_n_heads,
                      dsa_indexer_head_dim=flavor.index_head_dim, dsa_indexer_topk=flavor.index_topk,
                      dsa_indexer_loss_coeff=flavor.dsa_indexer_loss_coeff)
    return fields


def mla_attention_spec(provider: Any, flavor: DeepSeekFlavor) -> ModuleSpec:
    """Megatron's ``MLASelfAttention`` (as :class:`DeepSeekMLA`, whose rotated-key gradient is right at tp > 1) with
    the provider's linears, norms and core attention -- or, for DeepSeek sparse attention, the lightning indexer and
    sparse attention of :class:`~loongforge.models.sparse_attention.core_attention.DSACoreAttention` in its phase."""
    fused = provider.fuse_layernorm_and_linear()
    up = provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear()
    latent_norm = IdentityOp if fused else provider.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(
        module=DeepSeekMLA,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=provider.column_parallel_linear(),
            linear_q_down_proj=provider.column_parallel_linear(),
            linear_q_up_proj=up,
            linear_kv_down_proj=provider.column_parallel_linear(),
            linear_kv_up_proj=up,
            core_attention=_core_attention(provider, flavor),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=latent_norm if flavor.q_lora_rank is not None else IdentityOp,
            kv_layernorm=latent_norm,
        ),
    )


def _core_attention(provider: Any, flavor: DeepSeekFlavor) -> Any:
    if not flavor.is_dsa:
        return provider.core_attention()
    from loongforge.models.sparse_attention.core_attention import DSACoreAttention

    return ModuleSpec(module=DSACoreAttention, params={"phase": flavor.dsa_phase})


def layer_spec(provider: Any, flavor: DeepSeekFlavor, *, moe: bool) -> ModuleSpec:
    """One decoder layer: norm -> MLA -> residual, norm -> dense SwiGLU MLP or MoE (routed + shared) -> residual."""
    fused = provider.fuse_layernorm_and_linear()
    norm = provider.layer_norm(rms_norm=True, for_qk=False)
    keys: dict[str, str] = {}
    if not fused:  # store the norms under the names a fusing provider's modules give them
        keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
        if flavor.q_lora_rank is not None:
            keys["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        if not moe:
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=mla_attention_spec(provider, flavor),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused and not moe else norm,
            mlp=get_mlp_module_spec_for_backend(backend=provider, num_experts=flavor.num_experts if moe else None),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys,
        ),
    )


def layer_specs(flavor: DeepSeekFlavor, provider: Any, config: TransformerConfig) -> list[ModuleSpec]:
    """One spec per layer of the whole model: dense for the first ``first_k_dense``, MoE after."""
    dense, moe = layer_spec(provider, flavor, moe=False), None
    if flavor.is_moe:
        moe = layer_spec(provider, flavor, moe=True)
    return [moe if is_moe else dense for is_moe in flavor.moe_layers]


def mtp_block_spec(flavor: DeepSeekFlavor, provider: Any, config: TransformerConfig,
                   vp_stage: int | None = None) -> ModuleSpec | None:
    """The multi-token-prediction block of the stage that builds it (megatron: the last pipeline stage), else
    ``None``. Each MTP layer is megatron's ``MultiTokenPredictionLayer`` (``enorm``/``hnorm``, the ``2h -> h``
    ``eh_proj``, one DeepSeek layer -- MoE when the model has experts -- and its output norm)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
        get_mtp_num_layers_to_build,
    )

    if not flavor.mtp_num_layers or get_mtp_num_layers_to_build(config, vp_stage=vp_stage) == 0:
        return None
    norm = provider.layer_norm(rms_norm=True, for_qk=False)
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=provider.column_parallel_linear(),
            transformer_layer=layer_spec(provider, flavor, moe=flavor.is_moe), layer_norm=norm,
        ),
    )
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * flavor.mtp_num_layers))


def decoder_spec(flavor: DeepSeekFlavor) -> DecoderSpec:
    """The :class:`DecoderSpec` core builds ``flavor`` from: its layers, ``MLATransformerConfig`` and its fields,
    and the multi-token-prediction block."""
    mtp = None
    if flavor.mtp_num_layers:
        def mtp(provider: Any, config: TransformerConfig, vp_stage: int | None) -> ModuleSpec | None:
            return mtp_block_spec(flavor, provider, config, vp_stage)
    return DecoderSpec(
        layer_specs=lambda provider, config: layer_specs(flavor, provider, config),
        config_class=MLATransformerConfig,
        config_fields=config_fields(flavor),
        mtp_block_spec=mtp,
    )
