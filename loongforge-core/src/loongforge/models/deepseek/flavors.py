"""DeepSeek-architecture flavors: DeepSeek-V3 (671B), Kimi-K2, Moonlight, DeepSeek-V2-Lite and a tiny CPU one.

Real sizes copy the published ``config.json`` hyperparameters (``n_routed_experts``, ``moe_intermediate_size``,
``n_shared_experts * moe_intermediate_size``, ``first_k_dense_replace``, ``n_group``/``topk_group``,
``routed_scaling_factor``, ``rope_scaling``, ``num_nextn_predict_layers``); like the Hugging Face readers they train
with the aux-loss-free expert bias only (``moe_aux_loss_coeff`` 0: their ``aux_loss_alpha`` is not read). Kimi-K2 and
Moonlight are ``DeepseekV3ForCausalLM`` checkpoints (one expert group, their own vocabulary and RoPE base);
DeepSeek-V2-Lite is the V2 router (softmax scores, no expert bias, no renormalisation) on the same layers.

The tiny flavor has every feature the 671B model has on a CPU-sized model: a dense first layer, shared experts,
group-limited sigmoid routing with the expert bias, a routed scaling factor, the query LoRA, YaRN and one
multi-token-prediction block.
"""

from __future__ import annotations

from typing import Any

from loongforge.models.deepseek.flavor import DeepSeekFlavor

V3 = "DeepseekV3ForCausalLM"
V2 = "DeepseekV2ForCausalLM"
V32 = "DeepseekV32ForCausalLM"
#: MLA head sizes shared by every published DeepSeek-V2/V3-architecture model.
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
#: ``num_query_groups`` is derived (one per head); the tables pass the head count for the dataclass's sake.


def _v3(**kw: Any) -> DeepSeekFlavor:
    base: dict[str, Any] = dict(family="deepseek-v3", position_embedding="none", hf_architecture=V3,
                                moe_score_function="sigmoid", moe_expert_bias=True, moe_norm_topk_prob=True)
    merged = {**base, **kw}
    merged.setdefault("num_query_groups", merged["num_attention_heads"])
    return DeepSeekFlavor(**merged)


#: The tiny DeepSeek-V3 (see the table), which the tiny V3.2 extends.
_TINY_V3 = _v3(
    num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4, vocab_size=384,
    max_position_embeddings=2048, rope_theta=10000.0, norm_eps=1e-6, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, yarn_factor=4.0,
    yarn_original_max_position_embeddings=512, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, first_k_dense=1,
    num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
    moe_router_num_groups=4, moe_router_group_topk=2, moe_routed_scaling_factor=2.5, moe_bias_update_rate=1e-3,
    mtp_num_layers=1,
)

FLAVORS: dict[str, DeepSeekFlavor] = {
    "deepseek-v3": _v3(
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, vocab_size=129280,
        max_position_embeddings=163840, rope_theta=10000.0, norm_eps=1e-6, q_lora_rank=1536, **_MLA,
        yarn_factor=40.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, first_k_dense=3, num_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
        moe_router_group_topk=4, moe_routed_scaling_factor=2.5, mtp_num_layers=1,
    ),
    "kimi-k2": _v3(
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=64, vocab_size=163840,
        max_position_embeddings=131072, rope_theta=50000.0, norm_eps=1e-6, q_lora_rank=1536, **_MLA,
        yarn_factor=32.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=1.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, first_k_dense=1, num_experts=384, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_routed_scaling_factor=2.827,
    ),
    "moonlight-16b-a3b": _v3(
        num_layers=27, hidden_size=2048, ffn_hidden_size=11264, num_attention_heads=16, vocab_size=163840,
        max_position_embeddings=8192, rope_theta=50000.0, norm_eps=1e-5, q_lora_rank=None, **_MLA,
        first_k_dense=1, num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=2816, moe_routed_scaling_factor=2.446,
    ),
    "deepseek-v2-lite": _v3(
        family="deepseek-v2", hf_architecture=V2, num_layers=27, hidden_size=2048, ffn_hidden_size=10944,
        num_attention_heads=16, vocab_size=102400, max_position_embeddings=163840, rope_theta=10000.0,
        norm_eps=1e-6, q_lora_rank=None, **_MLA, yarn_factor=40.0, yarn_original_max_position_embeddings=4096,
        yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, first_k_dense=1,
        num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
        moe_score_function="softmax", moe_expert_bias=False, moe_norm_topk_prob=False, moe_routed_scaling_factor=1.0,
    ),
    # Every DeepSeek-V3 feature on a CPU-sized model; 8 experts in 4 groups so that ep=2 splits them and
    # group-limited routing (2 of 4 groups, top-4 experts: 2 per chosen group, as Hugging Face's router sums) bites.
    "deepseek-v3-tiny": _TINY_V3,
    # DeepSeek-V3.2: V3's layers with DeepSeek sparse attention (a 64-head lightning indexer choosing 2048 keys).
    "deepseek-v3.2": _v3(
        family="deepseek-v32", hf_architecture=V32,
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, vocab_size=129280,
        max_position_embeddings=163840, rope_theta=10000.0, norm_eps=1e-6, q_lora_rank=1536, **_MLA,
        yarn_factor=40.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, first_k_dense=3, num_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
        moe_router_group_topk=4, moe_routed_scaling_factor=2.5, index_n_heads=64, index_head_dim=128,
        index_topk=2048,
    ),
    # The tiny flavor with sparse attention that bites on CPU-sized sequences (16 keys of each query's past).
    "deepseek-v32-tiny": _TINY_V3.with_overrides(
        family="deepseek-v32", hf_architecture=V32, mtp_num_layers=0, index_n_heads=4, index_head_dim=32,
        index_topk=16, dsa_indexer_loss_coeff=0.1),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-V3-0324"),
    "kimi-k2": ("moonshotai/Kimi-K2-Base", "moonshotai/Kimi-K2-Instruct"),
    "moonlight-16b-a3b": ("moonshotai/Moonlight-16B-A3B", "moonshotai/Moonlight-16B-A3B-Instruct"),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
    "deepseek-v3.2": ("deepseek-ai/DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2-Exp"),
}
