"""``loongforge diff`` on a diffusion DiT: faults injected into a copy of a real checkpoint of the diffusion
certification recipe (qwen-image-tiny, one training step) -- a weight scaled in one block's image or text stream, in
the patch embedding, in a query norm, the rotary axes changed in the config -- are named where they begin:
the parameter that moved, the first module whose output parts, and the setting that differs. Each replay runs the
task's deterministic loss (seeded noise and timesteps), so an unchanged copy is identical."""

from __future__ import annotations

import json

import pytest
from loongforge.cli import main
from loongforge.testing.faults import faulty_checkpoint, recipe_checkpoint
from loongforge_diffusion.certification import IMAGE_DIT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return recipe_checkpoint(IMAGE_DIT, tmp_path_factory.mktemp("dit"))


def diff(capsys, a, b) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json"])
    return code, json.loads(capsys.readouterr().out)["models"]


@pytest.mark.parametrize(("fault", "parameter", "output", "setting"), [
    ({"tensor": ("blocks.2.img.ffn.fc1.weight", 1.01)}, "blocks.2.img.ffn.fc1.weight", "blocks.2.img.ffn.fc1", None),
    ({"tensor": ("blocks.1.txt.qkv.weight", 1.02)}, "blocks.1.txt.qkv.weight", "blocks.1.txt.qkv", None),
    ({"tensor": ("image_in.weight", 0.99)}, "image_in.weight", "image_in", None),
    ({"tensor": ("blocks.3.img.norm_q.weight", 1.05)}, "blocks.3.img.norm_q.weight", "blocks.3.img.norm_q", None),
    # RoPE is applied inside attention: the first module whose output parts is block 0's attention projection
    ({"overrides": {"axes_dims": [4, 12, 16]}}, None, "blocks.0.img.out", "axes_dims: (4, 14, 14) vs (4, 12, 16)"),
], ids=["ffn-block-2", "text-qkv-block-1", "patch-embedding", "qk-norm-block-3", "rope-axes"])
def test_an_injected_fault_is_named_where_it_begins(checkpoint, tmp_path, capsys, fault, parameter, output, setting):
    code, report = diff(capsys, checkpoint, faulty_checkpoint(checkpoint, tmp_path / "faulty", **fault))
    assert code == 1
    first = report["first_by_kind"]
    assert (first["parameter"] or {}).get("name") == parameter
    assert first["forward output"]["name"] == output
    assert report["settings"] == ([setting] if setting else [])


def test_an_unchanged_copy_is_identical(checkpoint, tmp_path, capsys):
    code, report = diff(capsys, checkpoint, faulty_checkpoint(checkpoint, tmp_path / "copy"))
    assert code == 0 and report["first"] is None and report["loss"][0] == report["loss"][1]
    assert report["compared"]["forward output"] > 50 and report["compared"]["gradient"] > 50
