"""``loongforge diff`` on a VLA policy: faults injected into a copy of a real checkpoint of the embodied
certification recipe (pi05-tiny, one training step) -- a weight scaled in the vision tower, in the action expert or
the prefix stream of one layer, the rotary base or the norms' epsilon changed in the config -- are named where they
begin: the parameter that moved, the first module whose output parts, and the setting that differs."""

from __future__ import annotations

import json

import pytest
from loongforge.cli import main
from loongforge.testing.faults import faulty_checkpoint, recipe_checkpoint
from loongforge_embodied.certification import POLICY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return recipe_checkpoint(POLICY, tmp_path_factory.mktemp("policy"))


@pytest.mark.parametrize(("fault", "parameter", "output", "setting"), [
    ({"tensor": ("vision.0.stream.qkv.weight", 1.01)}, "vision.0.stream.qkv.weight", "vision.0.stream.qkv", None),
    ({"tensor": ("layers.1.expert.mlp.down.weight", 1.01)}, "layers.1.expert.mlp.down.weight",
     "layers.1.expert.mlp.down", None),
    ({"tensor": ("layers.0.prefix.mlp.gate_up.weight", 0.99)}, "layers.0.prefix.mlp.gate_up.weight",
     "layers.0.prefix.mlp.gate_up", None),
    # RoPE is applied inside attention: the first module whose output parts is layer 0's attention projection
    ({"overrides": {"rope_theta": 500.0}}, None, "layers.0.expert.out", "rope_theta: 10000.0 vs 500.0"),
    ({"overrides": {"eps": 0.01}}, None, "vision.0.stream.norm1", "eps: 1e-06 vs 0.01"),
], ids=["vision-qkv", "expert-mlp-layer-1", "prefix-mlp-layer-0", "rope-base", "norm-epsilon"])
def test_an_injected_fault_is_named_where_it_begins(checkpoint, tmp_path, capsys, fault, parameter, output, setting):
    assert main(["diff", str(checkpoint), str(faulty_checkpoint(checkpoint, tmp_path / "faulty", **fault)),
                 "--json"]) == 1
    report = json.loads(capsys.readouterr().out)["models"]
    first = report["first_by_kind"]
    assert (first["parameter"] or {}).get("name") == parameter
    assert first["forward output"]["name"] == output
    assert report["settings"] == ([setting] if setting else [])


def test_a_task_checkpoint_and_a_decoder_are_not_compared(checkpoint, tmp_path, capsys):
    from loongforge.certify.recipes import DENSE_DECODER

    decoder = recipe_checkpoint(DENSE_DECODER, tmp_path / "llm")
    assert main(["diff", str(checkpoint), str(decoder)]) == 2
    error = capsys.readouterr().err.strip()
    assert "holds a task model" in error and "\n" not in error
