"""Weight conversion diffusers <-> LoongForge is exact and complete, and flavors register without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from diffusers import WanTransformer3DModel
from loongforge.errors import LoongForgeError
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, from_diffusers, to_diffusers
from loongforge_diffusion.wan.flavors import FLAVORS, num_params
from loongforge_diffusion.wan.model import WanModel
from loongforge_diffusion.wan.rope import axis_dims
from wan_reference import tiny_flavor


@pytest.mark.parametrize("task", ["t2v", "i2v", "ti2v"])
def test_round_trip_is_bitwise_both_ways(task):
    torch.manual_seed(0)
    flavor = tiny_flavor(task, 16)
    reference = WanTransformer3DModel(**diffusers_config(flavor))
    theirs = reference.state_dict()
    ours = from_diffusers(theirs)
    assert sorted(ours) == sorted(WanModel(flavor).state_dict())
    back = to_diffusers(ours)
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    model = WanModel(flavor)
    again = from_diffusers(to_diffusers(model.state_dict()))
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_param_count_formula_matches_both_models():
    for task in ("t2v", "i2v", "ti2v"):
        flavor = tiny_flavor(task, 16)
        reference = WanTransformer3DModel(**diffusers_config(flavor))
        count = num_params(flavor)
        assert count == sum(p.numel() for p in WanModel(flavor).parameters())
        assert count == sum(p.numel() for p in reference.parameters())


def test_unknown_names_are_errors():
    with pytest.raises(LoongForgeError, match="pos_embed"):
        from_diffusers({"condition_embedder.image_embedder.pos_embed": torch.zeros(1)})
    with pytest.raises(LoongForgeError, match="blocks.0.bogus"):
        to_diffusers({"blocks.0.bogus": torch.zeros(1)})


def test_rope_split_follows_the_reference():
    assert axis_dims(16) == (8, 4, 4)  # a d//3 split would give 5/5/6 or similar here
    assert axis_dims(64) == (24, 20, 20)
    assert axis_dims(128) == (44, 42, 42)  # the real models


def test_model_holds_no_buffers_so_dtype_casts_keep_rope_exact():
    model = WanModel(FLAVORS["wan-tiny"]).to(torch.bfloat16)
    assert list(model.buffers()) == []
    out = model(torch.randn(1, 3, 2, 4, 4, dtype=torch.bfloat16), torch.tensor([500.0]),
                torch.randn(1, 8, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, 2, 4, 4)


def test_published_sizes():
    expected = {  # parameters of one model (one expert), billions
        "wan2.1-t2v-1.3b": 1.42, "wan2.1-t2v-14b": 14.29, "wan2.1-i2v-14b": 16.39, "wan2.2-ti2v-5b": 5.00,
        "wan2.2-t2v-a14b": 14.29, "wan2.2-i2v-a14b": 14.29,
    }
    for name, billions in expected.items():
        assert round(num_params(FLAVORS[name]) / 1e9, 2) == billions, name
    assert FLAVORS["wan2.2-t2v-a14b"].expert_boundary == 0.875
    assert FLAVORS["wan2.2-i2v-a14b"].expert_boundary == 0.9


def test_registration_is_torch_free_and_resolves_aliases():
    code = (
        "import sys; from loongforge.registry import Registry; import loongforge_diffusion.plugin as p;"
        "r = Registry('model'); p.loongforge_register_models(r);"
        "print(','.join(r.names())); print(r.load('Wan-AI/Wan2.1-T2V-1.3B-Diffusers').dim);"
        "print('torch' in sys.modules)"
    )
    names, dim, torch_loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True).stdout.split()
    assert set(FLAVORS) <= set(names.split(","))  # the plugin registers other families too (Qwen-Image)
    assert dim == "1536" and torch_loaded == "False"
