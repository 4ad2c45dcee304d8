"""Numerical truth: our megatron models compute the same logits as transformers' reference models.

Tiny random models are built from transformers configs in code (no downloads), their weights are copied
into the megatron model through ``hf_adapter``, and fp32 logits must agree to 1e-4. Weights are drawn
with a large spread so that a mis-mapped head, bias or norm would move the logits by far more than that.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.hf_adapter import flavor_from_hf_config, fuse_qkv, hf_to_megatron  # noqa: E402

_COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=384, max_position_embeddings=256, rms_norm_eps=1e-6,
)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}

CASES = {
    # Llama 3.1-style RoPE scaling with a short original context, so the scaling changes most frequencies.
    "llama-llama3-rope-untied": ("LlamaConfig", "LlamaForCausalLM", "llama",
                                 dict(rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-linear-rope-tied": ("LlamaConfig", "LlamaForCausalLM", "llama",
                               dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                    tie_word_embeddings=True)),
    "qwen2-qkv-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
                            dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1000000.0})),
    # head_dim 32 with 4 heads (128) != hidden 64, as in real Qwen3 sizes.
    "qwen3-qk-norm-untied": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3",
                             dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-qk-norm-tied": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}


def _hf_model(config_cls: str, model_cls: str, extra: dict):
    config = getattr(transformers, config_cls)(**_COMMON, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)  # non-trivial norm weights catch a dropped/misplaced norm
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    return config, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(megatron_cpu_world, case):
    config_cls, model_cls, family, extra = CASES[case]
    config, hf = _hf_model(config_cls, model_cls, extra)
    flavor = flavor_from_hf_config(config, family=family)
    model = build_model(flavor, backend=megatron_cpu_world, params_dtype="fp32").eval()
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), flavor), strict=False)
    assert not unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing

    tokens = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = model(tokens, positions, None)
    assert actual.shape == expected.shape == (2, 48, 384)
    assert expected.std() > 0.5  # the comparison is not trivially small numbers
    assert (actual - expected).abs().max().item() <= 1e-4


def test_flavor_from_hf_config_reads_family_switches():
    config, _ = _hf_model("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True))
    flavor = flavor_from_hf_config(config, family="qwen3")
    assert (flavor.qk_layernorm, flavor.add_qkv_bias, flavor.tie_word_embeddings) == (True, False, True)
    assert (flavor.kv_channels, flavor.num_query_groups, flavor.norm_eps) == (32, 2, 1e-6)
    llama, _ = _hf_model(*CASES["llama-llama3-rope-untied"][:2], CASES["llama-llama3-rope-untied"][3])
    scaled = flavor_from_hf_config(llama, family="llama")
    assert scaled.rope_theta == 500000.0
    assert scaled.rope_scaling["rope_type"] == "llama3" and scaled.rope_scaling["factor"] == 8.0
    assert scaled.head_dim is None and scaled.kv_channels == 16


def test_fuse_qkv_interleaves_per_query_group():
    flavor = flavor_from_hf_config(_hf_model("LlamaConfig", "LlamaForCausalLM", {})[0], family="llama")
    d = flavor.kv_channels  # 4 heads in 2 groups, head_dim 16
    q = torch.arange(4 * d).float().unsqueeze(1)
    k = 1000 + torch.arange(2 * d).float().unsqueeze(1)
    v = 2000 + torch.arange(2 * d).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, flavor).squeeze(1)
    group0 = torch.cat([q[: 2 * d, 0], k[:d, 0], v[:d, 0]])
    group1 = torch.cat([q[2 * d :, 0], k[d:, 0], v[d:, 0]])
    assert torch.equal(fused, torch.cat([group0, group1]))
