"""Flavor tables match the published models; registration, overrides and the builder's config are right."""

from __future__ import annotations

import pytest
from loongforge.errors import ConfigError
from loongforge.models.flavor import DecoderFlavor, flavor_num_params
from loongforge.models.registration import all_flavors, register_builtin_models
from loongforge.registry import Registry

# Parameter counts of the Hugging Face checkpoints (safetensors metadata / model cards).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
}
# Qwen3 model cards publish rounded non-embedding counts.
QWEN3_NON_EMBEDDING_BILLIONS = {"qwen3-0.6b": 0.44, "qwen3-1.7b": 1.4, "qwen3-4b": 3.6, "qwen3-8b": 6.95}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_flavors_have_published_parameter_counts(name):
    assert flavor_num_params(all_flavors()[name]) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(QWEN3_NON_EMBEDDING_BILLIONS))
def test_qwen3_non_embedding_counts(name):
    count = flavor_num_params(all_flavors()[name], include_embeddings=False) / 1e9
    assert count == pytest.approx(QWEN3_NON_EMBEDDING_BILLIONS[name], abs=0.05)


def test_family_switches():
    flavors = all_flavors()
    assert flavors["llama3.1-8b"].rope_scaling["factor"] == 8.0
    assert flavors["llama3.2-1b"].rope_scaling["factor"] == 32.0
    assert flavors["llama3-8b"].rope_scaling is None and flavors["llama3-8b"].rope_theta == 500000.0
    assert all(flavors[n].add_qkv_bias and not flavors[n].qk_layernorm for n in flavors if n.startswith("qwen2"))
    assert all(flavors[n].qk_layernorm and flavors[n].kv_channels == 128 for n in QWEN3_NON_EMBEDDING_BILLIONS)
    assert flavors["qwen3-8b"].tie_word_embeddings is False and flavors["qwen3-4b"].tie_word_embeddings is True
    # The byte tokenizer has 259 ids; tiny flavors must cover it.
    assert all(flavors[n].vocab_size >= 259 for n in ("llama-tiny", "llama-debug", "qwen3-tiny"))


def test_with_overrides_returns_a_new_flavor_and_rejects_unknown_keys():
    base = all_flavors()["llama-tiny"]
    small = base.with_overrides(num_layers=2, vocab_size=512)
    assert (small.num_layers, small.vocab_size, base.num_layers) == (2, 512, 4)
    with pytest.raises(ConfigError, match="unknown flavor field.*num_layer\\b.*known: .*num_layers"):
        base.with_overrides(num_layer=2)
    with pytest.raises(ConfigError, match="multiple of num_query_groups"):
        base.with_overrides(num_query_groups=3)
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not supported"):
        base.with_overrides(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_register_builtin_models_with_hf_aliases():
    registry = Registry("model")
    register_builtin_models(registry)
    assert set(registry.names()) == set(all_flavors())
    assert registry.load("Qwen/Qwen3-0.6B") is all_flavors()["qwen3-0.6b"]
    assert registry.load("meta-llama/Meta-Llama-3-8B") is all_flavors()["llama3-8b"]
    description = registry.entry("qwen3-0.6b").description
    assert description == "qwen3 decoder, 596.05M params, 28 layers, d1024, 16/8 heads, qk-norm, tied"


def test_decoder_flavor_is_plain_data():
    flavor = DecoderFlavor(family="x", num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                           num_query_groups=1, vocab_size=10, max_position_embeddings=4)
    assert flavor.kv_channels == 4 and flavor.hf_architecture == "LlamaForCausalLM"


def test_transformer_config_and_vocab_padding():
    import torch
    from loongforge.models.decoder_model import ParallelSettings, padded_vocab_size, transformer_config

    assert [padded_vocab_size(v, tp) for v, tp in ((259, 1), (384, 2), (151936, 4), (100, 3))] == [
        384, 384, 151936, 384]
    qwen = all_flavors()["qwen3-tiny"]
    config = transformer_config(qwen, params_dtype="bf16", parallel=ParallelSettings(tp=2, sequence_parallel=True))
    assert (config.kv_channels, config.num_query_groups) == (64, 4)
    assert (config.qk_layernorm, config.add_qkv_bias) == (True, False)
    assert (config.params_dtype, config.bf16, config.gated_linear_unit, config.normalization) == (
        torch.bfloat16, True, True, "RMSNorm")
    assert (config.tensor_model_parallel_size, config.sequence_parallel, config.layernorm_epsilon) == (2, True, 1e-6)
    with pytest.raises(ConfigError, match="sequence_parallel needs tp > 1"):
        ParallelSettings(tp=1, sequence_parallel=True)
    with pytest.raises(ConfigError, match="not divisible by pp"):
        transformer_config(all_flavors()["llama-tiny"], parallel=ParallelSettings(pp=3))
    with pytest.raises(ConfigError, match="unknown params_dtype"):
        transformer_config(qwen, params_dtype="fp64")


def test_built_model_has_flavor_shapes(megatron_cpu_world):
    from loongforge.models.decoder_model import build_model

    flavor = all_flavors()["qwen3-tiny"]
    model = build_model(flavor, backend=megatron_cpu_world)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert shapes["embedding.word_embeddings.weight"] == (384, 256)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((8 + 2 * 4) * 64, 256)
    assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == (64,)
    assert shapes["decoder.layers.3.mlp.linear_fc1.weight"] == (2 * 768, 256)
    assert "output_layer.weight" not in shapes  # tied to the embedding
    assert sum(p.numel() for p in model.parameters()) == flavor_num_params(flavor)
