"""Qwen ViT flavors, the transformers state-dict adapter and the plugin's registration of the encoders."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_vlm.encoders.qwen_vit import QwenViT
from loongforge_vlm.encoders.qwen_vit_adapter import from_hf, to_hf
from loongforge_vlm.encoders.qwen_vit_flavors import FLAVORS, SOURCES, QwenViTFlavor, num_params
from loongforge_vlm.encoders.siglip_flavors import SIGLIP_FLAVORS
from qwen_vit_reference import QWEN2, QWEN25, hf_config, reference_class, reference_model


@pytest.mark.parametrize("flavor", [QWEN2, QWEN25], ids=["qwen2-vl", "qwen2.5-vl"])
def test_round_trip_is_bitwise_both_ways(flavor):
    theirs = reference_model(flavor).state_dict()
    ours = from_hf(theirs, flavor)
    model = QwenViT(flavor)
    assert sorted(ours) == sorted(model.state_dict())
    back = to_hf(ours, flavor)
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    again = from_hf(to_hf(model.state_dict(), flavor), flavor)
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_prefix_selects_the_tower_inside_a_whole_vlm_checkpoint():
    theirs = reference_model(QWEN25).state_dict()
    whole = {**{f"model.visual.{k}": v for k, v in theirs.items()}, "model.language_model.norm.weight": torch.ones(4)}
    ours = from_hf(whole, QWEN25, prefix="model.visual.")
    assert sorted(to_hf(ours, QWEN25, prefix="model.visual.")) == sorted(k for k in whole if "visual" in k)


def test_bad_state_dicts_are_refused_naming_the_tensor():
    theirs = reference_model(QWEN25).state_dict()
    ours = from_hf(theirs, QWEN25)
    with pytest.raises(LoongForgeError, match=r"lacks tensor 'blocks\.2\.mlp\.up_proj\.bias' of shape \(40,\)"):
        from_hf({k: v for k, v in theirs.items() if k != "blocks.2.mlp.up_proj.bias"}, QWEN25)
    with pytest.raises(LoongForgeError, match=r"'blocks\.4\.norm1\.weight' has no counterpart.*num_layers"):
        from_hf({**theirs, "blocks.4.norm1.weight": torch.ones(32)}, QWEN25)  # a 5-layer file
    with pytest.raises(LoongForgeError, match=r"'patch_embed\.proj\.weight' has shape \(32, 96\), expected "
                                              r"\(32, 3, 2, 4, 4\)"):
        from_hf({**theirs, "patch_embed.proj.weight": torch.zeros(32, 96)}, QWEN25)
    with pytest.raises(LoongForgeError, match=r"'merger\.fc2\.bias' has shape \(47,\), expected \(48,\)"):
        to_hf({**ours, "merger.fc2.bias": torch.zeros(47)}, QWEN25)
    with pytest.raises(LoongForgeError, match=r"lacks tensor 'blocks\.0\.mlp\.gate_proj\.weight'.*family"):
        from_hf(reference_model(QWEN2).state_dict(), QWEN25)  # a Qwen2-VL file


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_real_flavors_have_transformers_parameter_count(name):
    flavor = FLAVORS[name]
    with torch.device("meta"):
        model = reference_class(flavor)(hf_config(flavor))
    assert num_params(flavor) == sum(p.numel() for p in model.parameters())


def test_param_counts_of_the_published_towers():
    # Qwen2-VL's report gives a 675M-parameter ViT for every size (the merger's output width varies).
    assert num_params(FLAVORS["qwen2-vl-7b-vit"]) == 675_759_104
    assert num_params(FLAVORS["qwen2-vl-2b-vit"]) == 665_271_296
    assert num_params(FLAVORS["qwen2.5-vl-7b-vit"]) == 676_550_144
    assert num_params(QWEN2) == sum(p.numel() for p in QwenViT(QWEN2).parameters())


def test_flavor_validation():
    with pytest.raises(ConfigError, match="family must be one of"):
        QwenViTFlavor(family="qwen4-vl", dim=32, ffn_dim=64, num_heads=2, num_layers=1, out_dim=8)
    with pytest.raises(ConfigError, match="head dim 6 must be a multiple of 4"):
        QWEN2.with_overrides(dim=12)
    with pytest.raises(ConfigError, match="Qwen2.5-VL only"):
        QWEN2.with_overrides(window_size=16)
    with pytest.raises(ConfigError, match="window_size >= patch_size \\* spatial_merge_size \\(8\\)"):
        QWEN25.with_overrides(window_size=4)
    with pytest.raises(ConfigError, match=r"full_attention_blocks \[4\] outside 0\.\.3"):
        QWEN25.with_overrides(full_attention_blocks=[3, 4])
    with pytest.raises(ConfigError, match=r"unknown .*flavor field\(s\) depth"):
        QWEN25.with_overrides(depth=2)


def test_registration_covers_every_encoder_and_is_torch_free():
    code = (
        "import sys; from loongforge.registry import Registry; import loongforge_vlm.plugin as p;"
        "r = Registry('model'); p.loongforge_register_models(r);"
        "print(','.join(r.names())); print(r.load('qwen2.5-vl-7b-vit').out_dim); print('torch' in sys.modules)"
    )
    names, out_dim, torch_loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                  check=True).stdout.split()
    assert set(FLAVORS) | set(SIGLIP_FLAVORS) <= set(names.split(","))
    assert out_dim == "3584" and torch_loaded == "False"
