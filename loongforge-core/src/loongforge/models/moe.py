"""Mixture-of-experts flavors: Mixtral and Qwen3-MoE, real sizes and tiny CPU sizes.

Both families are their dense sibling (Llama-style attention; Qwen3 with QK-norm and explicit ``head_dim``)
with every MLP replaced by top-k routed SwiGLU experts and a softmax router whose chosen probabilities are
renormalised. Real sizes copy the published ``config.json`` hyperparameters (Mixtral: ``intermediate_size`` is
the expert width; Qwen3-MoE: ``moe_intermediate_size``, ``num_experts_per_tok``, ``router_aux_loss_coef``). The
tiny flavors train in seconds on two CPU cores; their expert counts are even so that ep=2 splits them.
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.qwen import _QWEN_VOCAB


def _mixtral(**kw: object) -> DecoderFlavor:
    base = dict(family="mixtral", rope_theta=1000000.0, norm_eps=1e-5, moe_router_topk=2, moe_aux_loss_coeff=0.02,
                hf_architecture="MixtralForCausalLM")
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


def _qwen3_moe(**kw: object) -> DecoderFlavor:
    base = dict(family="qwen3-moe", vocab_size=_QWEN_VOCAB, max_position_embeddings=40960, rope_theta=1000000.0,
                norm_eps=1e-6, qk_layernorm=True, head_dim=128, moe_aux_loss_coeff=0.001,
                hf_architecture="Qwen3MoeForCausalLM")
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


FLAVORS: dict[str, DecoderFlavor] = {
    "mixtral-8x7b": _mixtral(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                             num_query_groups=8, vocab_size=32000, max_position_embeddings=32768, num_experts=8,
                             moe_ffn_hidden_size=14336),
    "qwen3-30b-a3b": _qwen3_moe(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                                num_query_groups=4, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    "mixtral-tiny": _mixtral(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                             num_query_groups=2, vocab_size=384, max_position_embeddings=2048, num_experts=4,
                             moe_ffn_hidden_size=512),
    # Like the real Qwen3-MoE: head_dim * heads != hidden, many narrow experts, top-k > 2.
    "qwen3-moe-tiny": _qwen3_moe(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8,
                                 num_query_groups=4, head_dim=64, vocab_size=384, max_position_embeddings=2048,
                                 num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=128),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1",),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Base"),
}
