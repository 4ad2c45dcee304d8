"""Qwen2-VL / Qwen2.5-VL checkpoints convert both ways bitwise (Qwen3-VL's: test_qwen3_vl.py); config.json reads into
the same flavor and refuses what our model does not implement, in one line naming the file and key."""

from __future__ import annotations

import json

import pytest
import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.hf_interop import flavor_from_hf_config, from_hf, hf_config_dict, read_hf_config, to_hf
from loongforge_vlm.model.vlm import build_vlm
from safetensors.torch import load_file
from vlm_reference import hf_config, megatron_world, reference_model

TINY = ("qwen2-vl-tiny", "qwen2.5-vl-tiny")  # untied and tied embeddings

#: The flat pre-v5 layout of the published Qwen/Qwen2-VL-2B-Instruct config.json (text keys at the top level,
#: ``rope_scaling`` of type "mrope", ``in_chans``/``spatial_patch_size`` in the vision config).
PUBLISHED_QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}
#: The same for Qwen/Qwen2.5-VL-3B-Instruct (window attention, ``out_hidden_size``, ``tokens_per_second``).
PUBLISHED_QWEN25_VL_3B = {
    **{k: v for k, v in PUBLISHED_QWEN2_VL_2B.items() if k != "vision_config"},
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
    "num_attention_heads": 16, "num_hidden_layers": 36,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("name", TINY)
def test_hf_ours_hf_is_bitwise(name):
    flavor = FLAVORS[name]
    theirs = reference_model(flavor).state_dict()
    if flavor.foundation.tie_word_embeddings:  # saved checkpoints hold the tied matrix once
        theirs.pop("lm_head.weight")
    assert _equal(to_hf(from_hf(theirs, flavor), flavor), theirs)


@pytest.mark.parametrize("name", TINY)
def test_ours_hf_ours_is_bitwise(name):
    flavor = FLAVORS[name]
    with megatron_world() as backend:
        ours = build_vlm(flavor, backend=backend)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_()
    state = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert _equal(from_hf(to_hf(state, flavor), flavor), state)


def test_saved_checkpoint_and_published_layout_read_the_same(tmp_path):
    """``save_pretrained`` output (config.json + safetensors) reads back; so do the pre-v5 names."""
    flavor = FLAVORS["qwen2-vl-tiny"]
    reference = reference_model(flavor)
    reference.save_pretrained(tmp_path)
    assert read_hf_config(tmp_path) == flavor
    expected = from_hf(reference.state_dict(), flavor)
    assert _equal(from_hf(load_file(tmp_path / "model.safetensors"), flavor), expected)
    legacy = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
              for k, v in reference.state_dict().items()}
    assert _equal(from_hf(legacy, flavor), expected)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_config_round_trips(name):
    flavor = FLAVORS[name]
    if flavor.hf_architecture is None:
        with pytest.raises(ConfigError, match="has no Hugging Face format"):
            hf_config_dict(flavor)
        return
    assert flavor_from_hf_config(hf_config_dict(flavor)) == flavor
    assert flavor_from_hf_config(hf_config(flavor).to_dict()) == flavor  # as transformers writes it


@pytest.mark.parametrize(("name", "config"), [("qwen2-vl-2b", PUBLISHED_QWEN2_VL_2B),
                                              ("qwen2.5-vl-3b", PUBLISHED_QWEN25_VL_3B)])
def test_published_flat_config_reads_as_the_named_flavor(name, config):
    assert flavor_from_hf_config(config) == FLAVORS[name]


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("qwen2-vl-tiny", lambda c: c["text_config"].update(hidden_act="gelu"),
     r"text_config\.hidden_act='gelu' is not supported"),
    ("qwen2-vl-tiny", lambda c: c["text_config"].update(use_sliding_window=True),
     r"text_config\.use_sliding_window=True"),
    ("qwen2-vl-tiny", lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"),
     r"text_config\.rope_parameters\.mrope_se"),
    ("qwen2-vl-tiny", lambda c: c["vision_config"].update(hidden_act="gelu"), r"vision_config\.hidden_act 'gelu'"),
    ("qwen2-vl-tiny", lambda c: c["vision_config"].update(hidden_size=64),
     r"vision_config\.hidden_size \(64\) must equal"),
    ("qwen2-vl-tiny", lambda c: c.update(architectures=["LlavaForConditionalGeneration"]),
     r"'LlavaForConditionalGeneration' is not"),
    # Qwen3-VL-MoE: dense layers between the routed ones (transformers' mlp_only_layers / decoder_sparse_step)
    ("qwen3-vl-moe-tiny", lambda c: c["text_config"].update(mlp_only_layers=[1]),
     r"text_config\.mlp_only_layers=\[1\] is not supported"),
    ("qwen3-vl-moe-tiny", lambda c: c["text_config"].update(decoder_sparse_step=2),
     r"text_config\.decoder_sparse_step=2 is not supported"),
])
def test_unsupported_settings_are_one_line_errors(tmp_path, name, edit, message):
    config = hf_config_dict(FLAVORS[name])
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as caught:
        read_hf_config(tmp_path)
    assert str(caught.value).startswith(str(tmp_path / "config.json") + ": ") and "\n" not in str(caught.value)


def test_mismatched_state_dicts_are_refused_by_name():
    flavor = FLAVORS["qwen2.5-vl-tiny"]
    theirs = reference_model(flavor).state_dict()
    missing = {k: v for k, v in theirs.items() if k != "model.language_model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(LoongForgeError, match=r"lacks 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        from_hf(missing, flavor)
    with pytest.raises(LoongForgeError, match=r"'model\.multi_modal_projector\.x' belongs to neither"):
        from_hf({**theirs, "model.multi_modal_projector.x": torch.zeros(1)}, flavor)
    ours = from_hf(theirs, flavor)
    ours.pop("language_model.decoder.layers.0.mlp.linear_fc2.weight")
    with pytest.raises(LoongForgeError, match=r"lacks language-model tensor 'language_model\.decoder\.layers\.0"):
        to_hf(ours, flavor)
