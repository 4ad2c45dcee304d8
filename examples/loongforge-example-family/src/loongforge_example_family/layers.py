"""OLMo-2's decoder layer on megatron-core: megatron's own modules, arranged as OLMo-2 arranges them.

Hugging Face's ``Olmo2DecoderLayer`` computes::

    h   = x + post_attention_layernorm(attention(x))      # no norm before attention
    out = h + post_feedforward_layernorm(mlp(h))          # no norm before the MLP

and its attention normalises the *whole* query projection (width ``heads * head_dim``) and the whole key
projection (``kv_heads * head_dim``) with an RMSNorm before splitting them into heads and before RoPE.

Megatron's ``TransformerLayer`` normalises before each sublayer and its ``q_layernorm`` / ``k_layernorm`` slots
normalise each head on its own. So:

* the pre-norm slots hold ``IdentityOp``, and :class:`Olmo2Layer` (a ``TransformerLayer``) owns the two post-norms
  and applies each to its sublayer's output inside megatron's bias-dropout-add, just before the residual add;
* the ``q_layernorm`` / ``k_layernorm`` slots hold :class:`WholeWidthRMSNorm`, which megatron calls with the
  ``[seq, batch, heads, head_dim]`` query (key) after the QKV projection and before RoPE -- the place OLMo-2 norms
  them -- and which normalises over all heads at once. Under tensor parallelism each rank holds a slice of the
  heads, so the sum of squares is summed over the tensor-parallel ranks (forward and backward) and the norm
  weight is split like the heads: tp=2 computes what tp=1 does.

Every other module -- QKV and output projections, core attention, the MLP's linears, the post-norms -- comes from
the device's spec provider (``build.backend.spec_provider()``), so the family runs on every device plugin. The
whole-width norm is the one module of the family's own: a device's norm normalises the rows it is given and
cannot see the other ranks' heads; it is plain torch, which every device runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from loongforge.errors import ConfigError
from loongforge.models.chunks import DecoderSpec
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class _SumOverTensorParallelRanks(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group, forward and backward.

    Every rank uses the sum for its own heads, so the gradient of each rank's share is the sum of what all
    ranks send back -- an all-reduce in backward too (megatron's ``reduce_from_tensor_model_parallel_region``
    passes the gradient through unchanged, which is right only when the reduced value feeds replicated work).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class WholeWidthRMSNorm(MegatronModule):
    """RMSNorm over all ``heads`` of a projection (OLMo-2's ``q_norm`` / ``k_norm``), split over tensor-parallel ranks.

    Megatron builds it in the attention's ``q_layernorm`` / ``k_layernorm`` slot with ``hidden_size`` = head_dim
    and calls it with ``[seq, batch, heads / tp, head_dim]``; the RMS is taken over the whole ``heads * head_dim``
    width, summing the squares of every rank's heads. Computed in fp32 and scaled by the weight before the cast
    back, as transformers' ``Olmo2RMSNorm`` does. The weight (this rank's ``heads / tp * head_dim`` entries) is a
    tensor-parallel parameter split on dim 0, so checkpoints and layouts see one ``heads * head_dim`` vector.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, heads: int) -> None:
        super().__init__(config=config)
        self.tp = config.tensor_model_parallel_size
        self.width = heads * hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1).float()
        square_sum = flat.square().sum(-1, keepdim=True)
        if self.tp > 1:
            square_sum = _SumOverTensorParallelRanks.apply(square_sum,
                                                           parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(square_sum / self.width + self.eps)
        return (self.weight * normed).to(x.dtype).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """The weight as this rank's slice (axis 0) of the whole-width vector."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)


def _norm_before_add(norm: torch.nn.Module, bias_dropout_add: Callable) -> Callable:
    """Megatron's bias-dropout-add factory (``bda(training, fused)(output_and_bias, residual, p)``) with the
    sublayer's output (plus its bias) passed through ``norm`` first: OLMo-2's post-norm residual add."""

    def make(training: bool, fused: bool) -> Callable:
        add = bias_dropout_add(training, fused)

        def apply(output_and_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                  prob: float) -> torch.Tensor:
            output, bias = output_and_bias
            return add((norm(output if bias is None else output + bias), None), residual, prob)

        return apply

    return make


class Olmo2Layer(TransformerLayer):
    """Megatron's layer with OLMo-2's post-norms: ``h = x + post_attention_layernorm(attn(x))``,
    ``h + post_feedforward_layernorm(mlp(h))``. ``post_norm`` is the device's norm class (``provider.layer_norm``);
    the pre-norm slots of the spec are ``IdentityOp``."""

    def __init__(self, *args: Any, post_norm: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.inference_fuse_tp_communication:  # that path adds the residual without the bias-dropout-add
            raise ConfigError("olmo2: inference_fuse_tp_communication skips the post-norms; leave it off")

        def norm() -> torch.nn.Module:
            return build_module(post_norm, config=self.config, hidden_size=self.config.hidden_size,
                                eps=self.config.layernorm_epsilon)

        self.post_attention_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.self_attn_bda = _norm_before_add(self.post_attention_layernorm, self.self_attn_bda)
        self.mlp_bda = _norm_before_add(self.post_feedforward_layernorm, self.mlp_bda)


def olmo2_layer_spec(provider: Any, config: TransformerConfig) -> ModuleSpec:
    """One OLMo-2 layer from the device's ``provider`` (megatron's ``BackendSpecProvider``).

    The linears are the provider's plain ones (never its norm-fused ``column_parallel_layer_norm_linear``: there is
    no norm before them to fuse), the core attention and the post-norm class are the provider's.
    """
    norm = provider.layer_norm(rms_norm=True, for_qk=False)
    return ModuleSpec(
        module=Olmo2Layer,
        params={"post_norm": norm},
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.column_parallel_linear(),
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=ModuleSpec(module=WholeWidthRMSNorm, params={"heads": config.num_attention_heads}),
                    k_layernorm=ModuleSpec(module=WholeWidthRMSNorm, params={"heads": config.num_query_groups}),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                                                linear_fc2=provider.row_parallel_linear())),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def olmo2_layer_specs(provider: Any, config: TransformerConfig) -> list[ModuleSpec]:
    """Every layer of the whole model (core keeps the ones this pipeline stage builds): all alike."""
    return [olmo2_layer_spec(provider, config)] * config.num_layers


#: What ``Olmo2Flavor.build_chunk`` passes to ``build.decoder_chunk``: the layers are the family's, the
#: ``TransformerConfig`` is core's (no fields of its own).
OLMO2_DECODER = DecoderSpec(layer_specs=olmo2_layer_specs)
