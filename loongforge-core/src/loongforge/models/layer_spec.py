"""Megatron layer specs for a pre-norm decoder, built from a device backend's ``BackendSpecProvider``.

Megatron's own spec helpers hard-code their provider (``get_gpt_layer_local_spec`` always uses
``LocalSpecProvider``), so a device plugin could not swap in its attention or norm. These functions take the
provider from the selected backend, and handle both providers that fuse the norm into the following linear
(Transformer Engine) and those that do not. The norm type (RMSNorm/LayerNorm, zero-centred gamma), biases and
activation travel in the ``TransformerConfig``, which every provider's modules read; the residual form picks
the layer class (:mod:`loongforge.models.parallel_residual` for the parallel forms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from loongforge.devices.sdpa_attention import SDPAttention
from loongforge.errors import ConfigError
from loongforge.models.parallel_residual import ParallelResidualLayer
from loongforge.models.sandwich_norm import PostNormLayer, PostNormSelfAttention

if TYPE_CHECKING:
    from loongforge.models.flavor import DecoderFlavor


def decoder_layer_spec(
    provider: Any, *, qk_layernorm: bool, num_experts: int | None = None, rms_norm: bool = True,
    residual: str = "sequential", post_norms: bool = False, attn_logit_softcapping: float | None = None,
) -> ModuleSpec:
    """One pre-norm decoder layer: norm -> self-attention -> residual, norm -> MLP -> residual.

    ``residual`` (``DecoderFlavor.residual``) ``"parallel"`` gives both branches the layer input with their own
    norms; ``"parallel_shared_norm"`` gives them one norm, which is then never fused into a linear (a fused
    norm+linear owns its norm weight, and two of them could not share one), so the layer uses the provider's
    plain linears and keeps the norm under ``input_layernorm`` on every backend.

    ``post_norms`` (Gemma-2) normalises the attention and MLP outputs (:mod:`loongforge.models.sandwich_norm`).
    ``attn_logit_softcapping`` is passed to the provider's core attention, which must be core's
    :class:`~loongforge.devices.sdpa_attention.SDPAttention` (megatron-core's attention modules have no
    soft-capping).

    With ``num_experts`` the MLP is megatron's ``MoELayer`` (router, token dispatcher, experts) with the
    provider's expert modules (on CPU: ``SequentialMLP`` of local linears; the norm is never fused into an MoE
    layer, so the pre-MLP norm stays a separate module and keeps its own checkpoint name).

    With a non-fused provider the checkpoint key map stores the norms under the fused (Transformer Engine)
    names, so dist-checkpoints move between the CPU and CUDA backends.
    """
    shared_norm = residual == "parallel_shared_norm"
    fused = provider.fuse_layernorm_and_linear() and not shared_norm
    norm = provider.layer_norm(rms_norm=rms_norm, for_qk=False)
    qk_norm = provider.layer_norm(rms_norm=rms_norm, for_qk=True) if qk_layernorm else IdentityOp
    linear_qkv = provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear()
    if fused == provider.fuse_layernorm_and_linear():
        mlp = get_mlp_module_spec_for_backend(backend=provider, num_experts=num_experts)
    else:  # a fusing provider's MLP would fuse the (shared) norm into linear_fc1
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                                              linear_fc2=provider.row_parallel_linear()))
    layer: dict[str, Any] = {"module": TransformerLayer}
    if residual != "sequential":
        layer = {"module": ParallelResidualLayer, "params": {"shared_norm": shared_norm}}
    elif post_norms:
        layer = {"module": PostNormLayer, "params": {"post_norm": norm}}
    return ModuleSpec(
        **layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused else norm,
            self_attention=ModuleSpec(
                module=PostNormSelfAttention if post_norms else SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal, **({"post_norm": norm} if post_norms else {})},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=_core_attention(provider, attn_logit_softcapping),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if shared_norm or (fused and num_experts is None) else norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=(
                {}
                if fused or shared_norm
                else {
                    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    **({} if num_experts else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}),
                }
            ),
        ),
    )


def _core_attention(provider: Any, softcap: float | None) -> Any:
    """The provider's core attention, given the soft-cap when there is one (only SDPAttention takes it)."""
    attention = provider.core_attention()
    if softcap is None:
        return attention
    if not (isinstance(attention, type) and issubclass(attention, SDPAttention)):
        name = attention.__name__ if isinstance(attention, type) else repr(attention)
        raise ConfigError(f"attn_logit_softcapping needs core's SDPAttention; this device backend's core attention "
                          f"{name} has no soft-capping")
    return ModuleSpec(module=attention, params={"softcap": softcap})


def decoder_block_spec(
    provider: Any, config: TransformerConfig, flavor: DecoderFlavor, *, vp_stage: int | None = None,
    layer_specs: Callable[[Any, TransformerConfig], Sequence[ModuleSpec]] | None = None,
) -> TransformerBlockSubmodules:
    """The layers of ``flavor`` this pipeline stage (and virtual stage ``vp_stage``) builds plus the final norm.

    ``layer_specs`` (a family's :class:`~loongforge.models.decoder_model.DecoderSpec`) gives one spec per layer of
    the whole model; without it every layer is core's :func:`decoder_layer_spec` of the flavor's switches.
    """
    rms_norm = flavor.normalization == "RMSNorm"
    if layer_specs is None:
        layer = decoder_layer_spec(provider, qk_layernorm=flavor.qk_layernorm, num_experts=flavor.num_experts,
                                   rms_norm=rms_norm, residual=flavor.residual, post_norms=flavor.post_norms,
                                   attn_logit_softcapping=flavor.attn_logit_softcapping)
        every = [layer] * flavor.num_layers
    else:
        every = list(layer_specs(provider, config))
        if len(every) != flavor.num_layers:
            raise ConfigError(f"{flavor.family}: its layer_specs gave {len(every)} layer specs for "
                              f"{flavor.num_layers} layers")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = every[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=provider.layer_norm(rms_norm=rms_norm,
                                                                                      for_qk=False))
