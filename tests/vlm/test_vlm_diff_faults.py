"""``loongforge diff`` on a vision-language model: a transformers Qwen2-VL (tiny, from a config) converted to a
LoongForge checkpoint, against the conversion of a copy with one tensor scaled -- in the language model's MLP of
layer 1, its input norm of layer 0, the vision tower's attention and patch embedding -- names the parameter that
moved and the first module whose output parts. The replayed batch places an image in every sequence
(``VLMFlavor.replay_batch``), so a vision-tower fault is named at the vision module where it begins."""

from __future__ import annotations

import json
import shutil

import pytest
from loongforge.cli import main
from loongforge_vlm.model.flavors import FLAVORS
from safetensors.torch import load_file, save_file
from vlm_reference import reference_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-vl") / "hf"
    reference_model(FLAVORS["qwen2-vl-tiny"]).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ours") / "ckpt"
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(out)]) == 0
    return out


@pytest.mark.parametrize(("tensor", "parameter", "output"), [
    ("model.layers.1.mlp.down_proj.weight", "language_model.decoder.layers.1.mlp.linear_fc2.weight",
     "language_model.decoder.layers.1.mlp.linear_fc2"),
    ("model.layers.0.input_layernorm.weight", "language_model.decoder.layers.0.input_layernorm.weight",
     "language_model.decoder.layers.0.input_layernorm"),
    ("visual.blocks.0.attn.qkv.weight", "encoder.blocks.0.attn.qkv.weight", "encoder.blocks.0.attn.qkv"),
    ("visual.patch_embed.proj.weight", "encoder.patch_embed.weight", "encoder.patch_embed"),
], ids=["llm-mlp-layer-1", "llm-norm-layer-0", "vision-attention", "vision-patch-embedding"])
def test_an_injected_fault_is_named_where_it_begins(hf_dir, converted, tmp_path, capsys, tensor, parameter, output):
    variant = tmp_path / "hf"
    shutil.copytree(hf_dir, variant)
    tensors = load_file(variant / "model.safetensors")
    tensors[tensor] = tensors[tensor] * 1.02
    save_file(tensors, variant / "model.safetensors", {"format": "pt"})
    assert main(["convert", "hf-to-mcore", str(variant), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["diff", str(converted), str(tmp_path / "ckpt"), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["models"]["first_by_kind"]
    assert first["parameter"]["name"] == parameter
    assert (first["forward output"] or {}).get("name") == output
