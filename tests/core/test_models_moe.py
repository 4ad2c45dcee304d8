"""MoE flavors compute the same function as transformers' Mixtral and Qwen3-MoE, and map back losslessly.

Tiny random reference models are built from configs (no downloads); their router and expert weights go into
megatron's ``MoELayer`` through ``hf_adapter`` and fp32 logits must agree to 1e-4. Eight experts with top-2
(Mixtral) and top-4 without renormalisation (Qwen3-MoE ``norm_topk_prob=False``) exercise both router modes.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 - the test needs it installed
from conftest import HF_TINY_COMMON, make_hf_model  # noqa: E402
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.hf_adapter import (  # noqa: E402
    flavor_from_hf_config,
    hf_tensor_shapes,
    hf_to_megatron,
    megatron_to_hf,
)
from loongforge.models.registration import all_flavors  # noqa: E402

CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral",
                dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    "qwen3-moe-renormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3-moe",
                               dict(head_dim=32, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
                                    norm_topk_prob=True)),
    "qwen3-moe-full-softmax": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3-moe",
                               dict(head_dim=32, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
                                    norm_topk_prob=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_logits_match_transformers(megatron_cpu_world, case):
    config_cls, model_cls, family, extra = CASES[case]
    hf = make_hf_model(config_cls, model_cls, {**HF_TINY_COMMON, **extra})
    flavor = flavor_from_hf_config(hf.config, family=family)
    assert flavor.num_experts == 8 and flavor.moe_norm_topk_prob == extra.get("norm_topk_prob", True)
    model = build_model(flavor, backend=megatron_cpu_world, params_dtype="fp32").eval()
    hf_sd = hf.state_dict()
    assert {k: tuple(v.shape) for k, v in hf_sd.items()} == hf_tensor_shapes(flavor) | (
        {} if flavor.tie_word_embeddings else {"lm_head.weight": (flavor.vocab_size, flavor.hidden_size)}
    )
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf_sd, flavor), strict=False)
    assert not unexpected
    assert all(k.endswith("_extra_state") or k.endswith("expert_bias") for k in missing), missing

    tokens = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = model(tokens, positions, None)
    assert actual.shape == expected.shape == (2, 48, 384)
    assert expected.std() > 0.5
    assert (actual - expected).abs().max().item() <= 1e-4

    back = megatron_to_hf({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, flavor)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in back)


def test_per_expert_checkpoint_layout_is_read():
    """Mixtral checkpoints on disk keep one module per expert (w1 gate, w3 up, w2 down)."""
    hf = make_hf_model("MixtralConfig", "MixtralForCausalLM", {**HF_TINY_COMMON, "num_local_experts": 4})
    flavor = flavor_from_hf_config(hf.config, family="mixtral")
    fused = hf.state_dict()
    legacy = {k: v for k, v in fused.items() if ".mlp." not in k}
    for i in range(flavor.num_layers):
        moe, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        legacy[moe + "gate.weight"] = fused[new + "gate.weight"]
        for e in range(4):
            gate, up = fused[new + "experts.gate_up_proj"][e].chunk(2)
            legacy.update({f"{moe}experts.{e}.w1.weight": gate, f"{moe}experts.{e}.w3.weight": up,
                           f"{moe}experts.{e}.w2.weight": fused[new + "experts.down_proj"][e]})
    a, b = hf_to_megatron(fused, flavor), hf_to_megatron(legacy, flavor)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_published_moe_sizes():
    flavors = all_flavors()
    mixtral, qwen = flavors["mixtral-8x7b"], flavors["qwen3-30b-a3b"]
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (8, 2, 14336)
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size, qwen.num_layers) == (128, 8, 768, 48)
    from loongforge.models.flavor import flavor_num_params

    assert round(flavor_num_params(mixtral) / 1e9, 1) == 46.7
    assert round(flavor_num_params(qwen) / 1e9, 1) == 30.5
    assert flavors["mixtral-tiny"].num_experts % 2 == 0 and flavors["qwen3-moe-tiny"].num_experts % 2 == 0
