"""``loongforge diff --device-b/--tp-b``: one side replayed on another device backend or split over tensor-parallel
ranks (torchrun, gloo), its shards reassembled as one process holds them, compared module by module.

A converted Llama split over two ranks must equal its one-process replay in every output, parameter and gradient
(which holds the reassembly: column-parallel outputs by their weight's rows -- SwiGLU's gate and up blocks --,
attention heads and vocabulary shards by the one-process shapes). Faults of a device backend (tests/certify/
mutant_backends.py) must be named where they begin: a tensor-parallel all-reduce that drops a rank's partial sum
at the first module that reduces across ranks (the vocabulary-parallel embedding), and only when split; a norm
with the wrong epsilon at the first norm.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import make_hf_model, tiny_settings
from loongforge.cli import main

MUTANTS = Path(__file__).resolve().parents[1] / "certify"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    make_hf_model("LlamaConfig", "LlamaForCausalLM", tiny_settings("llama3-rope-untied")).save_pretrained(root / "hf")
    assert main(["convert", "hf-to-mcore", str(root / "hf"), str(root / "mcore")]) == 0
    return root / "mcore"


@pytest.fixture(autouse=True)
def mutants_importable(monkeypatch):
    """The workers find ``mutant_backends`` by import path, as a vendor's backend under development is found."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(MUTANTS), os.environ.get("PYTHONPATH", "")]))


def _diff(capsys, checkpoint, *extra) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diff", str(checkpoint), str(checkpoint), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)["models"]


def test_a_split_replay_equals_the_one_process_replay(checkpoint, capsys):
    code, models = _diff(capsys, checkpoint, "--tp-b", "2")
    assert (code, models["first"]) == (0, None)
    assert models["models"][1].endswith(", tp=2)")
    assert models["compared"] == {"parameter": 15, "forward output": 35, "gradient": 15}
    assert all(d["why"] == "" for kind in models["largest"].values() for d in kind)  # every shape reassembled


@pytest.mark.parametrize(("device", "tp", "kind", "name"), [
    ("mutant_backends:SkippedReduction", "2", "forward output", "embedding.word_embeddings"),
    ("mutant_backends:SkippedReduction", "1", None, None),  # one rank: nothing to reduce, nothing wrong
    ("mutant_backends:NormEpsilon", "1", "forward output", "decoder.layers.0.input_layernorm"),
    ("mutant_backends:NormBackward", "1", "gradient", "decoder.layers.1.mlp.linear_fc2.weight"),
], ids=["skipped-reduction-tp2", "skipped-reduction-tp1", "norm-epsilon", "norm-backward"])
def test_a_device_fault_is_named_where_it_begins(checkpoint, capsys, device, tp, kind, name):
    code, models = _diff(capsys, checkpoint, "--device-b", device, "--tp-b", tp)
    first = models["first"]
    assert code == (0 if kind is None else 1)
    assert (first and (first["kind"], first["name"])) == (kind and (kind, name))


@pytest.mark.parametrize(("extra", "message"), [
    (["--tp-a", "2", "--tp-b", "2"], "--tp-a and --tp-b: at most one side replays split"),
    (["--tp-b", "0"], "--tp-a/--tp-b >= 1"),
], ids=["both-split", "zero"])
def test_placements_that_cannot_be_compared_are_one_line(checkpoint, capsys, extra, message):
    assert main(["diff", str(checkpoint), str(checkpoint), *extra]) == 2
    assert message in capsys.readouterr().err
