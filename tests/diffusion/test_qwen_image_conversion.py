"""Qwen-Image weight conversion diffusers <-> LoongForge is exact and complete; flavors match the published model."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_diffusion.qwen_image.diffusers_adapter import diffusers_config, from_diffusers, to_diffusers
from loongforge_diffusion.qwen_image.flavors import FLAVORS, QwenImageFlavor, num_params
from loongforge_diffusion.qwen_image.model import QwenImageModel, pack_latents, sample_layout, unpack_latents
from loongforge_diffusion.qwen_image.rope import centred, rope_tables, text_start
from qwen_image_reference import TINY, TINY_WIDE, reference_model


@pytest.mark.parametrize("flavor", [TINY, TINY_WIDE], ids=["tiny", "wide"])
def test_round_trip_is_bitwise_both_ways(flavor):
    theirs = reference_model(flavor).state_dict()
    ours = from_diffusers(theirs, flavor)
    model = QwenImageModel(flavor)
    assert sorted(ours) == sorted(model.state_dict())
    back = to_diffusers(ours, flavor)
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    again = from_diffusers(to_diffusers(model.state_dict(), flavor), flavor)
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_bad_state_dicts_are_refused_naming_the_tensor():
    theirs = reference_model(TINY).state_dict()
    ours = from_diffusers(theirs, TINY)
    missing = {k: v for k, v in theirs.items() if k != "transformer_blocks.1.attn.norm_added_k.weight"}
    with pytest.raises(LoongForgeError, match=r"lacks tensor 'transformer_blocks\.1\.attn\.norm_added_k\.weight'"):
        from_diffusers(missing, TINY)
    with pytest.raises(LoongForgeError, match=r"'pos_embed\.freqs' has no counterpart"):
        from_diffusers({**theirs, "pos_embed.freqs": torch.zeros(1)}, TINY)
    with pytest.raises(LoongForgeError, match=r"'transformer_blocks\.2\.img_mod\.1\.weight' has no counterpart"):
        from_diffusers({**theirs, "transformer_blocks.2.img_mod.1.weight": torch.zeros(1)}, TINY)  # a 3-layer file
    bad = {**theirs, "transformer_blocks.0.attn.to_k.weight": torch.zeros(32, 31)}
    with pytest.raises(LoongForgeError, match=r"'transformer_blocks\.0\.attn\.to_k\.weight' has shape \(32, 31\)"):
        from_diffusers(bad, TINY)
    with pytest.raises(LoongForgeError, match=r"'head\.proj\.bias' has shape \(15,\), expected \(16,\)"):
        to_diffusers({**ours, "head.proj.bias": torch.zeros(15)}, TINY)
    with pytest.raises(LoongForgeError, match=r"lacks tensor 'blocks\.0\.txt\.qkv\.bias'"):
        to_diffusers({k: v for k, v in ours.items() if k != "blocks.0.txt.qkv.bias"}, TINY)


def test_param_count_formula_matches_both_models():
    for flavor in (TINY, TINY_WIDE):
        count = num_params(flavor)
        assert count == sum(p.numel() for p in QwenImageModel(flavor).parameters())
        assert count == sum(p.numel() for p in reference_model(flavor).parameters())


def test_real_flavor_is_diffusers_default_and_has_the_published_size():
    signature = inspect.signature(QwenImageTransformer2DModel.__init__)
    defaults = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    assert diffusers_config(FLAVORS["qwen-image"]) == {**defaults, "axes_dims_rope": tuple(defaults["axes_dims_rope"])}
    with torch.device("meta"):  # shapes only: 20B parameters are never allocated
        reference = QwenImageTransformer2DModel(**diffusers_config(FLAVORS["qwen-image"]))
    count = num_params(FLAVORS["qwen-image"])
    assert count == sum(p.numel() for p in reference.parameters()) == 20_430_401_088  # "20B" (20.4B) published


def test_rope_positions_are_centred_and_text_follows_the_images():
    assert centred(4).tolist() == [-2, -1, 0, 1]
    assert centred(5).tolist() == [-3, -2, -1, 0, 1]
    assert text_start([(1, 5, 8), (1, 7, 2)]) == 4
    image, text = rope_tables(((1, 2, 3),), 3, (4, 6, 6), 10000.0, torch.device("cpu"))
    assert image.shape == (6, 8) and text.shape == (3, 8) and image.dtype == torch.complex64
    # The first pair of each axis (channels 0, 2, 5) turns 1 rad per position: text token j sits at 1 + j on
    # every axis; image token (row r, col c) of the 2 x 3 grid at frame 0, row r - 1, column c - 2.
    assert torch.allclose(text[:, [0, 2, 5]].angle(), torch.arange(1.0, 4.0)[:, None].expand(3, 3))
    rows, cols = torch.meshgrid(torch.arange(2.0) - 1, torch.arange(3.0) - 2, indexing="ij")
    expected = torch.stack([torch.zeros(6), rows.flatten(), cols.flatten()], dim=1)
    assert torch.allclose(image[:, [0, 2, 5]].angle(), expected)


def test_sample_layout_is_checked():
    assert sample_layout([[(1, 2, 3)], [(1, 2, 3)]], 2, 6) == ((1, 2, 3),)
    assert sample_layout([(1, 2, 3), [1, 2, 3]], 2, 6) == ((1, 2, 3),)
    assert sample_layout([[(1, 2, 3), (1, 1, 2)]], 1, 8) == ((1, 2, 3), (1, 1, 2))
    with pytest.raises(ValueError, match="differ between samples"):
        sample_layout([(1, 2, 3), (1, 3, 2)], 2, 6)
    with pytest.raises(ValueError, match="describe 6 image tokens, hidden_states has 7"):
        sample_layout([(1, 2, 3)], 1, 7)


def test_pack_latents_follows_the_pipeline_order():
    latents = torch.randn(2, 4, 6, 10)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 15, 16)
    # Token (row 1, col 3), channel c, sub-position (i, j) is feature c * 4 + i * 2 + j.
    assert torch.equal(tokens[:, 1 * 5 + 3, 2 * 4 + 1 * 2 + 0], latents[:, 2, 2 + 1, 6 + 0])
    assert torch.equal(unpack_latents(tokens, 3, 5), latents)


def test_bf16_model_runs_and_holds_no_buffers():
    model = QwenImageModel(TINY).to(torch.bfloat16)
    assert list(model.buffers()) == []
    out = model(torch.randn(1, 6, 16, dtype=torch.bfloat16), torch.randn(1, 3, 24, dtype=torch.bfloat16), None,
                torch.tensor([0.5]), [(1, 2, 3)])
    assert out.dtype == torch.bfloat16 and out.shape == (1, 6, 16)


def test_flavor_validation():
    with pytest.raises(ConfigError, match="sum to 30, not head_dim 32"):
        QwenImageFlavor(num_layers=1, num_heads=1, head_dim=32, axes_dims=(10, 10, 10))
    with pytest.raises(ConfigError, match="guidance_embeds"):
        TINY.with_overrides(guidance_embeds=True)
    with pytest.raises(ConfigError, match="unknown qwen-image flavor field"):
        TINY.with_overrides(rope_theta=1.0)


def test_registration_is_torch_free_and_resolves_aliases():
    code = (
        "import sys; from loongforge.registry import Registry; import loongforge_diffusion.plugin as p;"
        "r = Registry('model'); p.loongforge_register_models(r);"
        "print(','.join(r.names())); print(r.load('Qwen/Qwen-Image').num_layers);"
        "print('torch' in sys.modules)"
    )
    names, layers, torch_loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                 check=True).stdout.split()
    assert set(FLAVORS) <= set(names.split(","))
    assert layers == "60" and torch_loaded == "False"
