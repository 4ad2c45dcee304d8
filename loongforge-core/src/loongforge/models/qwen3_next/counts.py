"""Parameter counts and the planner's :class:`~loongforge.models.sizing.DecoderTerms` of a Qwen3-Next flavor
(torch-free).

Core's grouped-query formulas do not fit a hybrid: a Gated DeltaNet layer has no attention heads in core's sense
(its own key/value heads, a causal convolution, a per-head decay and an output gate) and costs per token what its
recurrent state costs, not what the sequence length does; full-attention layers carry an output gate twice the
query width; some layers are dense. Counted here tensor by tensor as the Hugging Face checkpoint stores them.
Published: Qwen3-Next-80B-A3B, "80B total, 3B activated" (79.7B and 3.2B non-embedding active by this count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loongforge.models.qwen3_next.flavors import Qwen3NextFlavor
    from loongforge.models.sizing import DecoderTerms


@dataclass(frozen=True)
class _Widths:
    """The widths one token's layers are made of (names as in the DeltaNet and gated-attention docstrings)."""

    h: int  # hidden size
    q: int  # full attention: query width (heads * head dim), the same again for the output gate
    gate: int
    kv: int  # full attention: key (= value) width
    k: int  # DeltaNet: key heads * key head dim (queries and keys)
    v: int  # DeltaNet: value heads * value head dim
    v_heads: int
    channels: int  # DeltaNet: the convolved channels (q, k, v)

    @classmethod
    def of(cls, flavor: Qwen3NextFlavor) -> _Widths:
        q = flavor.num_attention_heads * flavor.kv_channels
        k = flavor.linear_num_key_heads * flavor.linear_key_head_dim
        v = flavor.linear_num_value_heads * flavor.linear_value_head_dim
        return cls(h=flavor.hidden_size, q=q, gate=q if flavor.attention_output_gate else 0,
                   kv=flavor.num_query_groups * flavor.kv_channels, k=k, v=v,
                   v_heads=flavor.linear_num_value_heads, channels=2 * k + v)


def full_attention_matrices(flavor: Qwen3NextFlavor) -> int:
    """Query (with its gate), key, value and output projections of one gated-attention layer."""
    w = _Widths.of(flavor)
    return w.h * (w.q + w.gate + 2 * w.kv) + w.q * w.h


def deltanet_matrices(flavor: Qwen3NextFlavor) -> int:
    """Input projection (q, k, v, z, b, a), causal convolution, ``A_log``/``dt_bias`` and output projection."""
    w = _Widths.of(flavor)
    return (w.h * (w.channels + w.v + 2 * w.v_heads) + w.channels * flavor.linear_conv_kernel_dim
            + 2 * w.v_heads + w.v * w.h)


def mlp_params(flavor: Qwen3NextFlavor, index: int, *, active: bool = False) -> int:
    """Layer ``index``'s MLP: dense SwiGLU, or router + routed experts (``active``: the top-k) + the gated shared
    expert."""
    h = flavor.hidden_size
    if not flavor.is_moe_layer(index):
        return 3 * h * flavor.ffn_hidden_size
    experts = flavor.moe_router_topk if active else flavor.num_experts or 0
    shared = flavor.moe_shared_expert_intermediate_size or 0
    gate = h if shared and flavor.moe_shared_expert_gate else 0
    return (flavor.num_experts or 0) * h + experts * 3 * h * (flavor.moe_ffn_hidden_size or 0) + 3 * h * shared + gate


def qwen3_next_num_params(flavor: Qwen3NextFlavor, *, include_embeddings: bool = True, active: bool = False) -> int:
    """Parameters of ``flavor`` with the unpadded vocabulary; ``active``: those one token uses (top-k experts)."""
    d, h = flavor.kv_channels, flavor.hidden_size
    total = h  # final norm
    for index, kind in enumerate(flavor.layer_kinds):
        if kind == "full_attention":
            total += full_attention_matrices(flavor) + 2 * d  # + the per-head q/k norms
        else:
            total += deltanet_matrices(flavor) + flavor.linear_value_head_dim  # + the gated output norm
        total += 2 * h + mlp_params(flavor, index, active=active)
    if include_embeddings:
        total += flavor.vocab_size * h * (1 if flavor.tie_word_embeddings else 2)
    return total


def qwen3_next_decoder_terms(flavor: Qwen3NextFlavor, kernels: str = "te") -> DecoderTerms:
    """One average layer of ``flavor`` by part: the gated-attention and DeltaNet layers weighted by their share of
    ``num_layers``, the MoE and dense MLPs too.

    Parameters: every projection (and the convolution, ``A_log``, ``dt_bias``) tensor-parallel; norms, router and the
    shared expert's gate whole; experts by ep and etp. Activations per token: norms' inputs and outputs
    (sequence-parallel); gated attention as core's grouped-query layer plus the gate and its sigmoid; DeltaNet's
    projection output, convolution input and output, the normalised queries and keys, the rule's output, its norm
    and the gated product; the MLPs as core counts them. FLOPs: the projections, the convolution, the gated delta
    rule as its recurrence costs it (three ``d_k x d_v`` products per value head and token: reading the state with
    the key and the query, writing it), causal attention ``2 q`` per position in the gated-attention layers only.
    """
    from loongforge.models.sizing import (
        SELECTIVE_CHOICES_DENSE,
        SELECTIVE_CHOICES_MOE,
        ActivationPart,
        DecoderTerms,
        FlopPart,
        ParamPart,
    )

    w, layers, n = _Widths.of(flavor), flavor.num_layers, flavor.num_attention_heads
    full = flavor.layer_kinds.count("full_attention") / layers
    linear = 1.0 - full
    moe = sum(flavor.is_moe_layer(i) for i in range(layers)) / layers
    dense = 1.0 - moe
    state = flavor.linear_key_head_dim * flavor.linear_value_head_dim * w.v_heads
    in_proj = w.channels + w.v + 2 * w.v_heads
    params = [ParamPart("attention", full * full_attention_matrices(flavor), "tp"),
              ParamPart("linear_attention", linear * deltanet_matrices(flavor), "tp"),
              ParamPart("norms", 2 * w.h + full * 2 * flavor.kv_channels + linear * flavor.linear_value_head_dim,
                        "none")]
    gated = (w.q + w.gate + 2 * w.kv) + w.q + w.kv + w.q + (w.q + n + flavor.num_query_groups) + 2 * w.gate
    activations = [ActivationPart("norms", 2 * (2 * w.h + 1), "sp"),
                   ActivationPart("attention", full * gated, "tp"),
                   ActivationPart("attention", full * n, "tp", recomputed_by=("core_attn",)),
                   ActivationPart("linear_attention", linear * (in_proj + 2 * w.channels + 2 * w.k + 4 * w.v), "tp")]
    flops = [FlopPart("attention_projections", full * 2 * full_attention_matrices(flavor), width=w.q, split="tp"),
             FlopPart("linear_attention_projections", linear * 2 * (w.h * in_proj + w.v * w.h), width=in_proj,
                      split="tp"),
             FlopPart("linear_attention", linear * 2 * (w.channels * flavor.linear_conv_kernel_dim + 3 * state),
                      split="tp"),
             FlopPart("core_attention", full * 2 * w.q, per_position=True, recomputed_by=("core_attn",))]
    glu = 5 if kernels == "local" else 3
    if dense:
        f = flavor.ffn_hidden_size
        params.append(ParamPart("mlp", dense * 3 * w.h * f, "tp"))
        activations.append(ActivationPart("mlp", dense * glu * f, "tp", recomputed_by=("mlp",)))
        flops.append(FlopPart("mlp", dense * 2 * 3 * w.h * f, width=f, split="tp", recomputed_by=("mlp",)))
    if moe:
        e, k, width = flavor.num_experts or 0, flavor.moe_router_topk, flavor.moe_ffn_hidden_size or 0
        shared = flavor.moe_shared_expert_intermediate_size or 0
        shared_gate = w.h if shared and flavor.moe_shared_expert_gate else 0
        params += [ParamPart("router", moe * (e * w.h + shared_gate), "none"),
                   ParamPart("shared_expert", moe * 3 * w.h * shared, "tp"),
                   ParamPart("experts", moe * e * 3 * w.h * width, "expert")]
        activations += [ActivationPart("router", moe * (e + 5 * k), "none"),
                        ActivationPart("experts", moe * k * w.h, "none", recomputed_by=("moe",)),
                        ActivationPart("experts", moe * k * (glu + 1) * width, "etp", recomputed_by=("moe",))]
        flops += [FlopPart("experts", moe * 2 * k * 3 * w.h * width, width=width, split="etp",
                           recomputed_by=("mlp", "moe")),
                  FlopPart("router", moe * 2 * (e * w.h + shared_gate), recomputed_by=("mlp", "moe"))]
        if shared:
            activations.append(ActivationPart("shared_expert", moe * glu * shared, "tp",
                                              recomputed_by=("shared_experts", "moe")))
            flops.append(FlopPart("shared_expert", moe * 2 * 3 * w.h * shared, width=shared, split="tp",
                                  recomputed_by=("mlp", "moe")))
    return DecoderTerms(
        num_layers=layers, hidden_size=w.h, vocab_size=flavor.vocab_size, params=tuple(params),
        activations=tuple(activations), flops=tuple(flops), tie_word_embeddings=flavor.tie_word_embeddings,
        num_experts=flavor.num_experts, moe_router_topk=flavor.moe_router_topk if moe else 0,
        context_parallel_width=full * (2 * w.q + 2 * w.kv),
        selective_recompute=SELECTIVE_CHOICES_MOE if moe else SELECTIVE_CHOICES_DENSE,
    )
