"""``loongforge certify --family``: registered families of every engine pass the model-family conformance suite
(what does not apply to a family -- a Hugging Face export for a DiT, generation for a policy -- is reported as not
applicable, not as proven), and a broken family fails at the suite test meant to see its fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def certify_family(*names: str, workdir: Path) -> tuple[int, dict, str]:
    out = workdir / "certificate.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "certify", "--family", *names, "--workdir",
                           str(workdir), "--output", str(out)], capture_output=True, text=True, env=env)
    assert out.is_file(), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text()), done.stdout


def test_families_of_every_engine_are_certified(tmp_path):
    status, certificate, report = certify_family("llama-tiny", "qwen-image-tiny", "pi05-tiny", workdir=tmp_path)
    assert status == 0, report
    assert certificate["kind"] == "family" and certificate["passed"]
    checks = {(c["recipe"], c["name"]): c["detail"] for c in certificate["checks"]}
    assert checks[("llama-tiny", "hf export computes what the model computes")] == "holds"
    assert checks[("llama-tiny", "greedy generation is deterministic")] == "holds"
    assert checks[("qwen-image-tiny", "hf export computes what the model computes")].startswith("not applicable")
    assert checks[("pi05-tiny", "greedy generation is deterministic")] == "not applicable: not a causal language model"
    assert checks[("pi05-tiny", "training steps reach every parameter")] == "holds"


def test_a_broken_family_fails_at_the_checks_that_see_its_fault(tmp_path):
    """A family whose last layer never computes: its parameters get no gradient, and transformers (which runs
    every layer) computes other logits from the export; the tensors still round-trip."""
    status, certificate, report = certify_family("mutant_families:SKIPPED_LAYER", workdir=tmp_path)
    assert status == 1, report
    failed = {c["name"]: c["detail"] for c in certificate["checks"] if not c["passed"]}
    assert failed.keys() == {"training steps reach every parameter", "hf export computes what the model computes"}
    assert "no gradient reached" in failed["training steps reach every parameter"]
    assert "computes other logits" in failed["hf export computes what the model computes"]
