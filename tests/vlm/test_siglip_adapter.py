"""The SigLIP state-dict adapter (exact both ways, errors naming the tensor) and the flavor table's sizes."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import LoongForgeError
from loongforge_vlm.encoders.siglip import SIGLIP_FLAVORS, SiglipVisionEncoder, from_hf_state_dict, to_hf_state_dict
from loongforge_vlm.encoders.siglip_flavors import SiglipFlavor, describe, num_params, parameter_shapes
from transformers import SiglipVisionConfig, SiglipVisionModel

TINY = SIGLIP_FLAVORS["siglip-tiny"]


def _hf(flavor: SiglipFlavor, **extra) -> SiglipVisionModel:
    torch.manual_seed(0)
    return SiglipVisionModel(SiglipVisionConfig(**{**flavor.to_hf_config(), **extra}))


def test_round_trips_are_bitwise():
    torch.manual_seed(1)
    ours = SiglipVisionEncoder(TINY).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(ours, TINY), TINY)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[n], ours[n]) for n in ours)

    theirs = _hf(TINY).state_dict()
    again = to_hf_state_dict(from_hf_state_dict(theirs, TINY), TINY)
    assert again.keys() == theirs.keys()
    assert all(torch.equal(again[n], theirs[n]) for n in theirs)


def test_converted_weights_load_strictly_into_both_models():
    ref = _hf(TINY)
    ours = SiglipVisionEncoder(TINY)
    ours.load_state_dict(from_hf_state_dict(ref.state_dict(), TINY), strict=True)
    fresh = SiglipVisionModel(SiglipVisionConfig(**TINY.to_hf_config()))
    fresh.load_state_dict(to_hf_state_dict(ours.state_dict(), TINY), strict=True)
    assert torch.equal(fresh.embeddings.patch_embedding.weight, ref.embeddings.patch_embedding.weight)


def test_published_layout_prefix_and_pooling_head_are_handled():
    """The published files hold ``vision_model.*`` beside a text tower, and a pooling head VLMs do not use."""
    ref = _hf(TINY, vision_use_head=True).state_dict()
    assert any(n.startswith("head.") for n in ref)
    checkpoint = {f"vision_model.{n}": t for n, t in ref.items()}
    checkpoint["text_model.embeddings.token_embedding.weight"] = torch.zeros(4, TINY.dim)
    ours = from_hf_state_dict(checkpoint, TINY, prefix="vision_model.")
    assert ours.keys() == parameter_shapes(TINY).keys()
    assert torch.equal(ours["pos_embed"], ref["embeddings.position_embedding.weight"])


def test_errors_name_the_tensor():
    theirs = _hf(TINY).state_dict()
    missing = dict(theirs)
    del missing["encoder.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(LoongForgeError, match=r"missing transformers tensor 'encoder\.layers\.1\.self_attn\.v_proj"):
        from_hf_state_dict(missing, TINY)
    with pytest.raises(LoongForgeError, match=r"unexpected transformers tensor 'encoder\.layers\.2\.layer_norm1"):
        from_hf_state_dict({**theirs, "encoder.layers.2.layer_norm1.weight": torch.zeros(TINY.dim)}, TINY)
    wrong = {**theirs, "post_layernorm.bias": torch.zeros(TINY.dim + 1)}
    with pytest.raises(LoongForgeError, match=r"'post_layernorm\.bias' has shape \(33,\), expected \(32,\)"):
        from_hf_state_dict(wrong, TINY)

    ours = from_hf_state_dict(theirs, TINY)
    with pytest.raises(LoongForgeError, match=r"missing tensor 'blocks\.0\.attn\.qkv\.bias'"):
        to_hf_state_dict({n: t for n, t in ours.items() if n != "blocks.0.attn.qkv.bias"}, TINY)
    with pytest.raises(LoongForgeError, match="unexpected tensor 'extra.weight'"):
        to_hf_state_dict({**ours, "extra.weight": torch.zeros(1)}, TINY)


def test_parameter_counts_match_transformers_including_so400m():
    """so400m is built on the meta device: its 27 blocks cost no memory. With its pooling head the published
    tower is ~428M parameters; the patch-token trunk we build is that minus the head."""
    with_head = {}
    for name, flavor in SIGLIP_FLAVORS.items():
        with torch.device("meta"):
            ours = sum(p.numel() for p in SiglipVisionEncoder(flavor).parameters())
            trunk = sum(p.numel() for p in _hf(flavor).parameters())
            with_head[name] = sum(p.numel() for p in _hf(flavor, vision_use_head=True).parameters())
        assert ours == trunk == num_params(flavor)
    so400m = SIGLIP_FLAVORS["siglip-so400m-patch14-384"]
    assert so400m.grid_size == 27 and so400m.num_positions == 729
    assert num_params(so400m) == 412_987_248
    assert 427e6 < with_head["siglip-so400m-patch14-384"] < 429e6
    assert "412.99M params" in describe(so400m)


def test_flavor_from_hf_config_round_trip_and_validation():
    for flavor in SIGLIP_FLAVORS.values():
        assert SiglipFlavor.from_hf_config(SiglipVisionConfig(**flavor.to_hf_config()).to_dict()) == flavor
    with pytest.raises(LoongForgeError, match="hidden_act 'gelu'"):
        SiglipFlavor.from_hf_config({"hidden_act": "gelu"})
    with pytest.raises(LoongForgeError, match="not divisible by num_heads"):
        TINY.with_overrides(num_heads=5)
    with pytest.raises(LoongForgeError, match=r"unknown .*flavor field\(s\) depth"):
        TINY.with_overrides(depth=3)
