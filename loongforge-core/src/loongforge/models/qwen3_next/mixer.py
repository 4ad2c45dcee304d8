"""The Gated DeltaNet token mixer of Qwen3-Next's linear-attention layers, as a megatron module whose linears and
norm come from the device's spec provider.

Why not megatron-core's ``GatedDeltaNet``: in megatron-core 0.16 it refuses to construct without the
flash-linear-attention package (``ImportError`` in ``__init__``; its ``deterministic_mode`` fallback still calls
that package's ``l2norm``), allocates on ``torch.cuda.current_device()``, and lays out its input projection as
``[q; k; v; z; beta; alpha]`` over all heads, so a tensor-parallel shard is six slices. This module keeps its
submodule names (``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``) but groups every
projection by key head as Qwen3-Next's own checkpoints do -- per key head ``[q, k, v, z, b, a]`` with the
``num_v_heads / num_k_heads`` value heads that read that key -- so a tensor-parallel shard of ``in_proj``, of
``conv1d`` (channels ``[q, k, v]`` per key head) and of ``A_log``/``dt_bias`` is one contiguous block of whole key
heads, cut the way megatron cuts every column-parallel weight. The sequence mixing itself is
:func:`loongforge.models.qwen3_next.deltanet.gated_delta_rule`, the replaceable seam.

Per token ``x`` (after the layer's input norm)::

    q, k, v, z, b, a = in_proj(x)                      (grouped by key head)
    q, k, v = silu(causal_depthwise_conv(q, k, v))     (kernel linear_conv_kernel_dim)
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)   (q, k repeated to the value heads)
    out_proj(rmsnorm(o) * silu(z))                     (per value head; this norm's weight is not zero-centred)

Masks: left padding (what batched generation sends; a padded token sees only itself and nobody sees it) is zeroed
before the convolution, as transformers does, so it changes nothing; packed documents (a block-causal mask) are
mixed one document at a time, so no state or convolution crosses a document boundary. Generation with megatron's
static inference context keeps each layer's convolution tail and recurrent state there and decodes a token in one
recurrent step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from loongforge.errors import ConfigError
from loongforge.models.qwen3_next.deltanet import gated_delta_rule, recurrent_gated_delta_rule
from loongforge.parallel.packed_rows import PackedRows

#: ``A = exp(A_log)`` starts evenly spread over this range across the value heads (megatron's ``A_init_range``),
#: the same for every layout (transformers draws it at random).
A_INIT_RANGE = (1.0, 16.0)
_CACHE_KEY = "qwen3_next_gated_delta_net"


@dataclass
class GatedDeltaNetSubmodules:
    """The provider's modules: the input projection (a column-parallel linear, or one with the layer's input norm
    fused), the per-head output norm and the output projection (row-parallel)."""

    in_proj: ModuleSpec | type = IdentityOp
    out_norm: ModuleSpec | type = IdentityOp
    out_proj: ModuleSpec | type = IdentityOp


def _plain_norm_config(config: TransformerConfig) -> TransformerConfig:
    """``config`` with a plain (not zero-centred) norm weight: the gated output norm's, whatever the layers' norms."""
    if not config.layernorm_zero_centered_gamma:
        return config
    plain = copy.copy(config)
    plain.layernorm_zero_centered_gamma = False
    return plain


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet: ``[s, b, h]`` in, ``([s, b, h], None)`` out, like megatron's attention modules."""

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int = 1,
                 pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.d_k, self.d_v = config.linear_key_head_dim, config.linear_value_head_dim
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if v_heads % k_heads or k_heads % tp:
            raise ConfigError(f"Gated DeltaNet: linear_num_value_heads ({v_heads}) must be a multiple of "
                              f"linear_num_key_heads ({k_heads}), which must be divisible by tp ({tp})")
        self.ratio = v_heads // k_heads
        self.k_heads, self.v_heads = k_heads // tp, v_heads // tp  # this rank's
        self.kernel = config.linear_conv_kernel_dim
        #: per key head: q, k (d_k each), v, z (ratio * d_v each), b, a (ratio each)
        self.group_sizes = [self.d_k, self.d_k, self.ratio * self.d_v, self.ratio * self.d_v, self.ratio, self.ratio]
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, k_heads * sum(self.group_sizes), config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1", tp_group=self.tp_group,
        )
        channels = self.k_heads * (2 * self.d_k + self.ratio * self.d_v)
        self.conv1d = torch.nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False,
                                      dtype=config.params_dtype)
        a_log = torch.linspace(*A_INIT_RANGE, v_heads).log().chunk(tp)[self._tp_rank()]
        self.A_log = torch.nn.Parameter(a_log.to(config.params_dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads, dtype=config.params_dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.out_norm = build_module(submodules.out_norm, config=_plain_norm_config(config), hidden_size=self.d_v,
                                     eps=config.layernorm_epsilon)
        self._sum_norm_grads_over_tp(tp)
        self.out_proj = build_module(
            submodules.out_proj, v_heads * self.d_v, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
        )

    def _tp_rank(self) -> int:
        return self.tp_group.rank() if self.tp_group is not None and self.tp_group.size() > 1 else 0

    def _sum_norm_grads_over_tp(self, tp: int) -> None:
        """The output norm's weight is replicated but each tensor-parallel rank normalises other heads: its gradient
        is the sum over the ranks (summed here, so megatron's sequence-parallel sum must not add it again)."""
        group = self.tp_group
        for param in self.out_norm.parameters():
            param.sequence_parallel = False
            if tp > 1:
                def summed(grad: torch.Tensor) -> torch.Tensor:
                    grad = grad.clone()
                    torch.distributed.all_reduce(grad, group=group)
                    return grad

                param.register_hook(summed)

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                inference_context: Any = None, packed_seq_params: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        """``hidden_states`` ``[s, b, h]`` (a sequence shard under sequence parallelism) -> ``([s, b, h], None)``."""
        if packed_seq_params is not None and not isinstance(packed_seq_params, PackedRows):
            raise ConfigError("Gated DeltaNet layers take packed rows as PackedRows (data.pack at cp 1) or a "
                              f"block-causal attention mask, not {type(packed_seq_params).__name__}")
        projected, _ = self.in_proj(hidden_states)  # [s, b, local]: the whole sequence
        length, batch = projected.shape[:2]
        padding, segments = _mask_layout(attention_mask, length)
        if packed_seq_params is not None:  # each packed document alone, as its block of the mask says
            segments = packed_seq_params.row_spans()
        if padding is not None:
            projected = projected.masked_fill(padding.t()[..., None], 0.0)
        grouped = projected.view(length, batch, self.k_heads, sum(self.group_sizes))
        q, k, v, z, b, a = grouped.split(self.group_sizes, dim=-1)
        conv_in = torch.cat([q, k, v], dim=-1).reshape(length, batch, -1).permute(1, 2, 0)  # [b, C, s]
        beta = b.reshape(length, batch, self.v_heads).transpose(0, 1).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(length, batch, self.v_heads).transpose(0, 1).float()
                                                    + self.dt_bias)
        if inference_context is not None:
            mixed = self._mix_cached(conv_in, g, beta, inference_context)
        elif segments is not None:
            mixed = _per_document(self._mix, conv_in, g, beta, segments)
        else:
            mixed = self._mix(conv_in, g, beta)
        # [b, s, v_heads, d_v] -> gated norm per value head -> [s, b, v_heads * d_v]
        gate = z.reshape(length, batch, self.v_heads, self.d_v).transpose(0, 1)
        normed = (self.out_norm(mixed) * F.silu(gate.float())).to(hidden_states.dtype)
        out, bias = self.out_proj(normed.transpose(0, 1).reshape(length, batch, -1))
        return out, bias

    def _conv(self, conv_in: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise convolution then SiLU; ``tail`` holds the ``kernel - 1`` inputs before ``conv_in``."""
        padded = F.pad(conv_in, (self.kernel - 1, 0)) if tail is None else torch.cat([tail, conv_in], dim=-1)
        return F.silu(F.conv1d(padded, self.conv1d.weight, groups=conv_in.shape[1]))

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[b, C, s]`` convolved channels -> ``q``, ``k`` ``[b, s, v_heads, d_k]``, ``v`` ``[b, s, v_heads, d_v]``."""
        batch, _, length = conv_out.shape
        per_head = conv_out.transpose(1, 2).reshape(batch, length, self.k_heads, -1)
        q, k, v = per_head.split([self.d_k, self.d_k, self.ratio * self.d_v], dim=-1)
        if self.ratio > 1:
            q, k = q.repeat_interleave(self.ratio, dim=2), k.repeat_interleave(self.ratio, dim=2)
        return q, k, v.reshape(batch, length, self.v_heads, self.d_v)

    def _mix(self, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """A whole sequence through the convolution and the gated delta rule (the seam)."""
        q, k, v = self._heads(self._conv(conv_in))
        out, _ = gated_delta_rule()(q, k, v, g, beta, scale=self.d_k**-0.5, use_qk_l2norm_in_kernel=True)
        return out

    def _mix_cached(self, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, context: Any) -> torch.Tensor:
        """Generation: the prompt through the chunked rule, then each new token in one recurrent step, the
        convolution tail and recurrent state kept in ``context`` between calls."""
        store = context.key_value_memory_dict
        key = (_CACHE_KEY, self.layer_number)
        tail, state = store[key] if context.sequence_len_offset > 0 and key in store else (None, None)
        q, k, v = self._heads(self._conv(conv_in, tail))
        rule = recurrent_gated_delta_rule if state is not None and conv_in.shape[-1] == 1 else gated_delta_rule()
        out, state = rule(q, k, v, g, beta, scale=self.d_k**-0.5, initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        before = F.pad(conv_in, (self.kernel - 1, 0)) if tail is None else torch.cat([tail, conv_in], dim=-1)
        store[key] = (before[..., before.shape[-1] - (self.kernel - 1):], state)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """``A_log``, ``dt_bias`` and ``conv1d.weight`` split over tensor-parallel ranks on their first axis (whole key
        heads each); the linears and the norm as their own modules say."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
                                                      tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            if name == "conv1d":
                sharded.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}conv1d.", {"weight": 0}, sharded_offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
            else:
                sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        return sharded


def _mask_layout(mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor | None, list | None]:
    """From megatron's ``[b, 1, s, s]`` mask (``True`` = hidden): the padding tokens ``[b, s]`` (a token that sees
    only itself and that no other token sees, never the last one) and, when some row packs several documents, each
    row's ``(start, end)`` document spans. ``(None, None)`` without a full square mask (plain causal, or a cached
    generation step)."""
    if mask is None or mask.dim() != 4 or mask.shape[-1] != length or mask.shape[-2] != length:
        return None, None
    visible = ~mask[:, 0] & ~torch.eye(length, dtype=torch.bool, device=mask.device)
    padding = ~visible.any(-1) & ~visible.any(-2)
    padding[:, -1] = False
    real = ~padding
    # a document starts where a real token cannot see the real token before it
    starts = real[:, 1:] & real[:, :-1] & ~visible.diagonal(offset=-1, dim1=1, dim2=2)
    if not bool(starts.any()):
        return (padding if bool(padding.any()) else None), None
    segments = []
    for row in starts:
        cuts = [0, *(int(i) + 1 for i in row.nonzero().flatten()), length]
        segments.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return (padding if bool(padding.any()) else None), segments


def _per_document(mix: Any, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  segments: list) -> torch.Tensor:
    """``mix`` run on each document of each row alone (no state or convolution crosses a boundary)."""
    rows = []
    for row, spans in enumerate(segments):
        rows.append(torch.cat([mix(conv_in[row:row + 1, :, s:e], g[row:row + 1, s:e], beta[row:row + 1, s:e])
                               for s, e in spans], dim=1))
    return torch.cat(rows, dim=0)
