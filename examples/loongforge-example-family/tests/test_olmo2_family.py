"""The OLMo-2 example family passes LoongForge's model-family conformance suite -- the test every family author
copies -- and its reader refuses, in one line naming the key, what the family does not build."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.errors import ConfigError, InteropError
from loongforge.testing.family_suite import ModelFamilySuite
from loongforge_example_family.flavors import FLAVORS
from loongforge_example_family.hf import Olmo2Reader


class TestOlmo2Tiny(ModelFamilySuite):
    family = FLAVORS["olmo2-tiny"]
    has_hf_adapter = True


def test_discovered_with_version():
    import loongforge_example_family
    from loongforge.testing.discovery import assert_discovered

    assert_discovered("example-family", "loongforge-example-family", loongforge_example_family.__version__)


RAW = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 500000.0}}


def test_reader_reads_the_tiny_flavor_back():
    assert Olmo2Reader().read_config(dict(RAW), Path("config.json")) == FLAVORS["olmo2-tiny"]


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("hidden_act", "gelu"),
                                        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}),
                                        ("num_hidden_layers", None)])
def test_reader_refuses_what_the_family_does_not_build(key, value):
    with pytest.raises(InteropError, match=f"^dir/config.json: .*{key if key != 'rope_parameters' else 'rope_type'}"):
        Olmo2Reader().read_config({**RAW, key: value}, Path("dir/config.json"))


def test_switches_of_another_layer_are_refused():
    with pytest.raises(ConfigError, match="post_norms=True is not part of the OLMo-2 layer"):
        FLAVORS["olmo2-tiny"].with_overrides(post_norms=True)
