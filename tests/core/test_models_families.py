"""GPT-2, GPT-NeoX (Pythia), Phi-2 and Gemma as DecoderFlavor rows: the same function as transformers.

For each family a tiny random transformers model is built from a config in code (no downloads), loaded into
our megatron model through ``hf_adapter``, and fp32 logits must agree to 1e-5 on the real vocabulary rows
(the vocabulary, 389, is not a multiple of 128, so megatron's padded rows exist and are ignored). The
flavor read from the config must carry the family's switches, its parameter count must equal the transformers
model's, and a switch we do not implement must fail in one line naming file and key.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HF_FAMILY_CASES, make_hf_model, tiny_settings  # noqa: E402
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.flavor import flavor_num_params  # noqa: E402
from loongforge.models.hf_adapter import flavor_from_hf_config, hf_tensor_shapes, hf_to_megatron, megatron_to_hf
from loongforge.models.hf_layouts import hf_names  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

FAMILY_OF = {"gpt2-tied": "gpt2", "pythia-parallel-rotary": "gpt-neox", "phi-shared-norm-gqa": "phi",
             "gemma-geglu-gqa": "gemma", "gemma2-softcap-window": "gemma2"}
#: The switches each case's flavor must have read (the rest of the flavor is sizes).
SWITCHES = {
    "gpt2-tied": dict(normalization="LayerNorm", activation="gelu_tanh", gated_linear_unit=False,
                      add_bias_linear=True, position_embedding="learned_absolute", tie_word_embeddings=True),
    "pythia-parallel-rotary": dict(normalization="LayerNorm", activation="gelu", gated_linear_unit=False,
                                   add_bias_linear=True, residual="parallel", rotary_percent=0.25,
                                   tie_word_embeddings=False),
    "phi-shared-norm-gqa": dict(normalization="LayerNorm", activation="gelu_tanh", residual="parallel_shared_norm",
                                rotary_percent=0.4, output_layer_bias=True, num_query_groups=2),
    "gemma-geglu-gqa": dict(norm_zero_centered=True, activation="gelu_tanh", gated_linear_unit=True,
                            embedding_multiplier=8.0, head_dim=32, num_query_groups=2, tie_word_embeddings=True),
    "gemma2-softcap-window": dict(norm_zero_centered=True, post_norms=True, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=4.0, sliding_window=8, sliding_window_full_every=2,
                                  query_pre_attn_scalar=24),
}


def _case(case):
    config_cls, model_cls, _ = HF_FAMILY_CASES[case]
    hf = make_hf_model(config_cls, model_cls, tiny_settings(case))
    return hf, flavor_from_hf_config(hf.config, family=FAMILY_OF[case])


@pytest.mark.parametrize("case", sorted(HF_FAMILY_CASES))
def test_family_logits_match_transformers(megatron_cpu_world, case):
    hf, flavor = _case(case)
    assert {k: getattr(flavor, k) for k in SWITCHES[case]} == SWITCHES[case]
    model = build_model(flavor, backend=megatron_cpu_world, params_dtype="fp32").eval()
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), flavor, padded_vocab_size=512),
                                                strict=False)
    assert not unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing

    tokens = torch.randint(0, 389, (2, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = model(tokens, positions, None)
    assert actual.shape == (2, 48, 512) and expected.shape == (2, 48, 389)
    assert expected.std() > 0.5  # the comparison is not trivially small numbers
    diff = (actual[..., :389] - expected).abs().max().item()
    print(f"\n{case}: max |logits - transformers| = {diff:.2e} (logit std {expected.std():.2f})")
    assert diff <= 1e-5


@pytest.mark.parametrize("case", sorted(HF_FAMILY_CASES))
def test_family_mapping_is_an_exact_inverse_and_counts_parameters(tmp_path, case):
    hf, flavor = _case(case)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")  # the names and tensors of a checkpoint file
    assert {k: tuple(v.shape) for k, v in saved.items()} == hf_tensor_shapes(flavor)
    back = megatron_to_hf(hf_to_megatron(saved, flavor, padded_vocab_size=512), flavor)
    assert sorted(back) == sorted(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    assert flavor_num_params(flavor) == sum(p.numel() for p in hf.parameters())


def test_gpt2_conv1d_and_stacked_qkv_are_reordered_per_group():
    hf, flavor = _case("gpt2-tied")
    mg = hf_to_megatron(hf.state_dict(), flavor)
    c_attn = hf.state_dict()["transformer.h.0.attn.c_attn.weight"]  # Conv1D: [in, 3 * out] = [q | k | v]
    q, k, v = c_attn.t().split(64)
    head = 16  # GPT-2 is multi-head: every head is its own group, [q_h; k_h; v_h]
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.weight"][: 3 * head],
                       torch.cat([q[:head], k[:head], v[:head]]))


UNSUPPORTED = {
    "gpt2-tied": ("activation_function", "gelu_fast"),
    "pythia-parallel-rotary": ("attention_bias", False),
    "phi-shared-norm-gqa": ("qk_layernorm", True),
    "gemma-geglu-gqa": ("hidden_act", "gelu_fast"),
    "gemma2-softcap-window": ("layer_types", ["sliding_attention", "full_attention", "full_attention",
                                              "sliding_attention"]),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unexpressible_switch_fails_in_one_line_naming_file_and_key(tmp_path, case):
    from loongforge.errors import InteropError
    from loongforge.models.hf_format import read_hf_model

    hf, _ = _case(case)
    hf.config.save_pretrained(tmp_path)
    key, value = UNSUPPORTED[case]
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(InteropError) as info:
        read_hf_model(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message and key in message, message


REAL = {"gpt2": 124_439_808, "pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "phi-2": 2_779_683_840,
        "gemma-2b": 2_506_172_416, "gemma2-2b": 2_614_341_888}  # published parameter counts


@pytest.mark.parametrize("name", sorted(REAL))
def test_registered_real_size_rows_are_the_published_models(tmp_path, name):
    import transformers
    from loongforge.models.hf_config import hf_config_dict
    from loongforge.models.hf_format import read_hf_model
    from loongforge.models.registration import all_flavors

    flavor = all_flavors()[name]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(flavor, "bf16")))
    assert read_hf_model(tmp_path).family == flavor  # the row survives its own config.json
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):  # transformers' own model of that config.json, without allocating it
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in hf.parameters()) == flavor_num_params(flavor) == REAL[name]
    in_memory = dict(hf_names(flavor.family).in_memory)  # transformers 5 renames some tensors on load
    expected = {in_memory.get(k, k): shape for k, shape in hf_tensor_shapes(flavor).items()}
    actual = {k: tuple(v.shape) for k, v in hf.state_dict().items()
              if not (flavor.tie_word_embeddings and k == "lm_head.weight")}
    assert actual == expected


BAD_SWITCHES = {
    "activation": (dict(activation="gelu_fast"), "activation 'gelu_fast' is not supported; supported: silu"),
    "normalization": (dict(normalization="ScaleNorm"), "normalization 'ScaleNorm' is not supported"),
    "position": (dict(position_embedding="alibi"), "position_embedding 'alibi' is not supported"),
    "residual": (dict(residual="sandwich"), "residual 'sandwich' is not supported"),
    "rotary-range": (dict(rotary_percent=1.5), "rotary_percent must be in (0, 1]"),
    "rotary-without-rope": (dict(position_embedding="learned_absolute", rotary_percent=0.5),
                            "rotary_percent 0.5 needs position_embedding 'rope'"),
    "odd-rotary": (dict(rotary_percent=0.2), "must rotate an even number of dimensions"),
    "parallel-moe": (dict(residual="parallel", num_experts=4, moe_ffn_hidden_size=32),
                     "residual 'parallel' is not supported with experts"),
}


@pytest.mark.parametrize("bad", sorted(BAD_SWITCHES))
def test_bad_switch_is_a_one_line_config_error_naming_it(bad):
    from loongforge.errors import ConfigError
    from loongforge.models.registration import all_flavors

    overrides, message = BAD_SWITCHES[bad]
    with pytest.raises(ConfigError) as info:
        all_flavors()["llama-debug"].with_overrides(**overrides)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_flavor_defaults_are_llama_and_build_the_same_modules(megatron_cpu_world):
    from loongforge.models.registration import all_flavors

    flavor = all_flavors()["llama-debug"]
    assert (flavor.normalization, flavor.activation, flavor.gated_linear_unit, flavor.add_bias_linear,
            flavor.position_embedding, flavor.rotary_percent, flavor.residual) == (
        "RMSNorm", "silu", True, False, "rope", 1.0, "sequential")
    model = build_model(flavor, backend=megatron_cpu_world)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert type(model.decoder.layers[0]).__name__ == "TransformerLayer"



class _FusingProvider:
    """A spec provider that fuses norms into the following linear, as Transformer Engine's does (stand-in
    classes: only the spec's structure is checked, nothing is built)."""

    class Norm: ...
    class NormLinear: ...
    class Linear: ...
    class RowLinear: ...
    class Attention: ...

    def fuse_layernorm_and_linear(self):
        return True

    def layer_norm(self, rms_norm=False, for_qk=False):
        return self.Norm

    def column_parallel_layer_norm_linear(self):
        return self.NormLinear

    def column_parallel_linear(self):
        return self.Linear

    def row_parallel_linear(self):
        return self.RowLinear

    def core_attention(self):
        return self.Attention

    def activation_func(self):
        return None


@pytest.mark.parametrize("residual", ["sequential", "parallel", "parallel_shared_norm"])
def test_fused_norm_linear_provider_keeps_fusing_except_for_a_shared_norm(residual):
    from loongforge.models.layer_spec import decoder_layer_spec
    from megatron.core.transformer.identity_op import IdentityOp

    p = _FusingProvider()
    layer = decoder_layer_spec(p, qk_layernorm=False, rms_norm=False, residual=residual).submodules
    qkv, fc1 = layer.self_attention.submodules.linear_qkv, layer.mlp.submodules.linear_fc1
    if residual == "parallel_shared_norm":  # one norm module feeds both branches; no fused copy of it
        assert (layer.input_layernorm, layer.pre_mlp_layernorm, qkv, fc1) == (p.Norm, IdentityOp, p.Linear, p.Linear)
    else:
        assert (layer.input_layernorm, layer.pre_mlp_layernorm, qkv, fc1) == (
            IdentityOp, IdentityOp, p.NormLinear, p.NormLinear)
    assert layer.sharded_state_dict_keys_map == {}


def test_attention_softcap_needs_core_sdpa_attention():
    from loongforge.errors import ConfigError
    from loongforge.models.layer_spec import decoder_layer_spec

    with pytest.raises(ConfigError, match="attn_logit_softcapping needs core's SDPAttention; .* Attention has no"):
        decoder_layer_spec(_FusingProvider(), qk_layernorm=False, attn_logit_softcapping=50.0)
