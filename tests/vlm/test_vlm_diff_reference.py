"""``loongforge diff CHECKPOINT HF_DIR --reference B`` on a vision-language model: the directory runs in transformers'
own Qwen2-VL / Qwen2.5-VL (``VLMFlavor.reference_implementation``) on a batch with an image in every sequence, and
is compared with the converted LoongForge checkpoint module by module under transformers' names -- the vision
tower's blocks and merger as well as the language model's layers. A tensor changed on either side is named as
the parameter that moved and at the first module it changes."""

from __future__ import annotations

import json
import shutil

import pytest
from loongforge.cli import main
from loongforge_vlm.model.flavors import FLAVORS
from safetensors.torch import load_file, save_file
from vlm_reference import reference_model

SEQ = ["--seq-length", "40"]  # room for the replayed image's markers and placeholders


@pytest.fixture(scope="module", params=["qwen2-vl-tiny", "qwen2.5-vl-tiny"])
def converted(request, tmp_path_factory):
    """A transformers VLM with weights drawn away from init, saved, and its LoongForge conversion."""
    root = tmp_path_factory.mktemp(request.param)
    reference_model(FLAVORS[request.param]).save_pretrained(root / "hf")
    assert main(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ckpt")]) == 0
    return root


def _diff(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diff", *argv, *SEQ, "--json"])
    return code, json.loads(capsys.readouterr().out)["models"]


def test_a_converted_vlm_computes_what_transformers_computes(converted, capsys):
    code, models = _diff(capsys, str(converted / "ckpt"), str(converted / "hf"), "--reference", "B", "--top", "999")
    assert (code, models["first"]) == (0, None), models["first"]
    assert models["models"][1].startswith("vlm in transformers (")
    names = {d["name"] for kind in models["largest"].values() for d in kind}
    assert {"model.visual.blocks.0", "model.visual.merger", "model.language_model.layers.0", "lm_head"} <= names
    # every transformers parameter compared; outputs of both halves (each block, norm, projection, the merger)
    assert models["compared"]["parameter"] == models["compared"]["gradient"] >= 58
    assert models["compared"]["forward output"] >= 36


@pytest.mark.parametrize(("tensor", "reference_side", "parameter", "output"), [
    ("visual.blocks.1.attn.proj.weight", "B", "model.visual.blocks.1.attn.proj.weight",
     "model.visual.blocks.1.attn.proj"),
    ("model.layers.0.mlp.down_proj.weight", "A", "model.language_model.layers.0.mlp.down_proj.weight",
     "model.language_model.layers.0.mlp.down_proj"),
], ids=["vision-projection", "language-mlp"])
def test_a_changed_tensor_in_the_directory_is_named_in_transformers_terms(converted, tmp_path, capsys, tensor,
                                                                          reference_side, parameter, output):
    variant = tmp_path / "hf"
    shutil.copytree(converted / "hf", variant)
    tensors = load_file(variant / "model.safetensors")
    tensors[tensor] = tensors[tensor] * 1.02
    save_file(tensors, variant / "model.safetensors", {"format": "pt"})
    sides = [str(variant), str(converted / "ckpt")]
    code, models = _diff(capsys, *(sides if reference_side == "A" else sides[::-1]), "--reference", reference_side)
    assert code == 1
    assert models["first_by_kind"]["parameter"]["name"] == parameter
    assert models["first_by_kind"]["forward output"]["name"] == output
