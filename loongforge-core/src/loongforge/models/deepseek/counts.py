"""Parameter counts and the planner's :class:`~loongforge.models.sizing.DecoderTerms` of a DeepSeek flavor
(torch-free).

Core's grouped-query formulas do not fit: MLA's low-rank projections and unequal query/key and value head widths,
the dense first layers, shared experts and multi-token-prediction blocks are counted here, tensor by tensor as the
Hugging Face checkpoint stores them (the expert-bias buffers are not parameters and not counted). Published
totals: DeepSeek-V3 671,026,404,352 without and 682.6B with its MTP block (its files hold 14,848 bias entries more
and the MTP block's copies of embedding and head), Kimi-K2 1.026T (32.9B active), DeepSeek-V2-Lite 15,706,484,224.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loongforge.models.deepseek.flavor import DeepSeekFlavor
    from loongforge.models.sizing import DecoderTerms


def attention_params(flavor: DeepSeekFlavor) -> int:
    """One MLA block: query path (low-rank with its norm, or one projection), the key/value latent with its norm,
    the latent's up-projection to per-head keys and values, and the output projection."""
    h, heads = flavor.hidden_size, flavor.num_attention_heads
    if flavor.q_lora_rank is None:
        query = h * heads * flavor.qk_head_dim
    else:
        query = h * flavor.q_lora_rank + flavor.q_lora_rank + flavor.q_lora_rank * heads * flavor.qk_head_dim
    latent = h * (flavor.kv_lora_rank + flavor.qk_rope_head_dim) + flavor.kv_lora_rank
    up = flavor.kv_lora_rank * heads * (flavor.qk_nope_head_dim + flavor.v_head_dim)
    return query + latent + up + heads * flavor.v_head_dim * h + indexer_params(flavor)


def indexer_params(flavor: DeepSeekFlavor) -> int:
    """DeepSeek sparse attention's lightning indexer: query up-projection, key projection with its LayerNorm,
    per-head weights (none without DSA)."""
    if not flavor.is_dsa:
        return 0
    n, d, h = flavor.index_n_heads or 0, flavor.index_head_dim, flavor.hidden_size
    return (flavor.q_lora_rank or h) * n * d + h * d + 2 * d + h * n


def mlp_params(flavor: DeepSeekFlavor, moe: bool, *, active: bool = False) -> int:
    """One layer's MLP: dense SwiGLU, or router + routed experts (only the ``moe_router_topk`` a token uses when
    ``active``) + shared experts."""
    h = flavor.hidden_size
    if not moe:
        return 3 * h * flavor.ffn_hidden_size
    experts = flavor.moe_router_topk if active else (flavor.num_experts or 0)
    shared = flavor.moe_shared_expert_intermediate_size or 0
    return (flavor.num_experts or 0) * h + experts * 3 * h * (flavor.moe_ffn_hidden_size or 0) + 3 * h * shared


def layer_params(flavor: DeepSeekFlavor, moe: bool, *, active: bool = False) -> int:
    """One decoder layer: two norms, attention, MLP."""
    return 2 * flavor.hidden_size + attention_params(flavor) + mlp_params(flavor, moe, active=active)


def mtp_params(flavor: DeepSeekFlavor, *, active: bool = False) -> int:
    """The multi-token-prediction blocks: per block two input norms, the ``2h -> h`` projection, one layer (MoE
    when the model has experts) and the output norm; embedding and LM head are the main model's."""
    h = flavor.hidden_size
    per_block = 3 * h + 2 * h * h + layer_params(flavor, flavor.is_moe, active=active)
    return flavor.mtp_num_layers * per_block


def deepseek_num_params(flavor: DeepSeekFlavor, *, include_embeddings: bool = True, active: bool = False,
                        include_mtp: bool = True) -> int:
    """Parameters of ``flavor`` with the unpadded vocabulary; ``active``: those one token uses (top-k experts)."""
    total = sum(layer_params(flavor, moe, active=active) for moe in flavor.moe_layers) + flavor.hidden_size
    if include_mtp:
        total += mtp_params(flavor, active=active)
    if include_embeddings:
        total += flavor.vocab_size * flavor.hidden_size * (1 if flavor.tie_word_embeddings else 2)
    return total


def deepseek_decoder_terms(flavor: DeepSeekFlavor, kernels: str = "te") -> DecoderTerms:
    """One average layer of ``flavor`` by part (:class:`~loongforge.models.sizing.DecoderTerms`): the dense first
    layers and the MoE layers weighted by their share of ``num_layers``, the MTP blocks (an MoE layer, the ``2h -> h``
    projection, three norms and one more output-layer product each) spread over the layers too.

    Parameters: every MLA matrix is tensor-parallel (the down-projections are column-parallel linears); norms and the
    router whole; experts by ep and etp. Activations per token: norms' inputs and outputs (sequence-parallel), the
    query and key/value latents and their norms' outputs (sequence-parallel), the per-head queries, keys, values,
    rotated copies and output (tensor-parallel), one log-sum-exp per head (dropped by recomputing ``core_attn``), the
    MLP or the MoE parts as core's decoder counts them. FLOPs: the projections, the MLP or ``k`` experts + router +
    shared experts, and causal attention ``heads * (qk + v)`` per position.
    """
    from loongforge.models.sizing import (
        SELECTIVE_CHOICES_DENSE,
        SELECTIVE_CHOICES_MOE,
        ActivationPart,
        DecoderTerms,
        FlopPart,
        ParamPart,
    )

    h, n, layers = flavor.hidden_size, flavor.num_attention_heads, flavor.num_layers
    moe_share = sum(flavor.moe_layers) / layers
    mtp_share = flavor.mtp_num_layers / layers
    moe_w = moe_share + mtp_share  # MoE layers per decoder layer, MTP blocks' layers included
    dense_w = 1.0 - moe_share
    attention_w = 1.0 + mtp_share
    q_lora, kv_lora = flavor.q_lora_rank or 0, flavor.kv_lora_rank
    latent_norms = q_lora + kv_lora
    matrices = attention_params(flavor) - latent_norms
    qk, v = n * flavor.qk_head_dim, n * flavor.v_head_dim
    params = [ParamPart("attention", attention_w * matrices, "tp"),
              ParamPart("norms", attention_w * (2 * h + latent_norms) + mtp_share * 3 * h, "none")]
    latents = 2 * q_lora + 2 * kv_lora + flavor.qk_rope_head_dim
    per_head = 2 * qk + v + 2 * n * flavor.qk_rope_head_dim + v
    activations = [ActivationPart("norms", attention_w * 2 * (2 * h + 1), "sp"),
                   ActivationPart("attention", attention_w * latents, "sp"),
                   ActivationPart("attention", attention_w * per_head, "tp"),
                   ActivationPart("attention", attention_w * n, "tp", recomputed_by=("core_attn",))]
    flops = [FlopPart("attention_projections", attention_w * 2 * matrices, width=qk, split="tp"),
             FlopPart("core_attention", attention_w * (qk + v), per_position=True, recomputed_by=("core_attn",))]
    glu = 5 if kernels == "local" else 3
    if dense_w:
        f = flavor.ffn_hidden_size
        params.append(ParamPart("mlp", dense_w * 3 * h * f, "tp"))
        activations.append(ActivationPart("mlp", dense_w * glu * f, "tp", recomputed_by=("mlp",)))
        flops.append(FlopPart("mlp", dense_w * 2 * 3 * h * f, width=f, split="tp", recomputed_by=("mlp",)))
    if flavor.is_moe:
        e, k, width = flavor.num_experts or 0, flavor.moe_router_topk, flavor.moe_ffn_hidden_size or 0
        shared = flavor.moe_shared_expert_intermediate_size or 0
        params += [ParamPart("router", moe_w * e * h, "none"), ParamPart("shared_expert", moe_w * 3 * h * shared, "tp"),
                   ParamPart("experts", moe_w * e * 3 * h * width, "expert")]
        activations += [ActivationPart("router", moe_w * (e + 5 * k), "none"),
                        ActivationPart("experts", moe_w * k * h, "none", recomputed_by=("moe",)),
                        ActivationPart("experts", moe_w * k * (glu + 1) * width, "etp", recomputed_by=("moe",))]
        flops += [FlopPart("experts", moe_w * 2 * k * 3 * h * width, width=width, split="etp",
                           recomputed_by=("mlp", "moe")),
                  FlopPart("router", moe_w * 2 * e * h, recomputed_by=("mlp", "moe"))]
        if shared:
            activations.append(ActivationPart("shared_expert", moe_w * glu * shared, "tp",
                                              recomputed_by=("shared_experts", "moe")))
            flops.append(FlopPart("shared_expert", moe_w * 2 * 3 * h * shared, width=shared, split="tp",
                                  recomputed_by=("mlp", "moe")))
    if flavor.mtp_num_layers:
        vocab = flavor.vocab_size
        params.append(ParamPart("mtp_projection", mtp_share * 2 * h * h, "tp"))
        activations.append(ActivationPart("mtp_projection", mtp_share * (4 * h + vocab), "tp"))
        flops += [FlopPart("mtp_projection", mtp_share * 2 * 2 * h * h, width=h, split="tp"),
                  FlopPart("mtp_output_layer", mtp_share * 2 * vocab * h, width=vocab, split="tp")]
    return DecoderTerms(
        num_layers=layers, hidden_size=h, vocab_size=flavor.vocab_size, params=tuple(params),
        activations=tuple(activations), flops=tuple(flops), tie_word_embeddings=flavor.tie_word_embeddings,
        num_experts=flavor.num_experts, moe_router_topk=flavor.moe_router_topk if flavor.is_moe else 0,
        context_parallel_width=2 * qk + 2 * v,
        selective_recompute=SELECTIVE_CHOICES_MOE if flavor.is_moe else SELECTIVE_CHOICES_DENSE,
    )
