"""``loongforge certify``: the CPU backend is certified by every check, and every MUTANT backend of
tests/certify/mutant_backends.py fails -- at the check meant to see its fault, naming the module where a module can
be named.

One CPU certification (all checks, layouts tp2/pp2/dp2) trains the reference into a shared work directory; each
mutant's certification reuses that reference and runs the checks that find it (``--checks``), so the zoo costs one
short training run or one pair of traces per mutant.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def certify(*args: str, workdir: Path) -> tuple[int, dict, str]:
    """Run ``loongforge certify`` (this directory importable, for the mutants); its exit status, certificate and
    output."""
    out = workdir / "certificate.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "certify", *args, "--workdir", str(workdir),
                           "--output", str(out)], capture_output=True, text=True, env=env)
    assert out.is_file(), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def cpu_certificate(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("certify")
    status, certificate, report = certify("--device", "cpu", "--recipes", "llm", workdir=workdir)
    return workdir, status, certificate, report


def test_the_cpu_backend_is_certified_by_every_check(cpu_certificate):
    _, status, certificate, report = cpu_certificate
    assert status == 0, report
    assert certificate["passed"] and certificate["complete"]
    assert {check["recipe"] for check in certificate["checks"]} == {"llm"}
    checks = {check["name"]: check for check in certificate["checks"]}
    assert list(checks) == ["train (1 process)", "modules (one batch)", "final weights", "resume on device",
                            "checkpoint to cpu", "layout tp2", "layout pp2", "layout dp2"]
    # the CPU against itself is exact; layouts sum in another order, within the fp32 tolerance
    for name in ("train (1 process)", "modules (one batch)", "final weights", "resume on device", "checkpoint to cpu"):
        assert checks[name]["measured"] == 0.0, checks[name]
    for name in ("layout tp2", "layout pp2", "layout dp2"):
        assert checks[name]["passed"] and checks[name]["measured"] < checks[name]["tolerance"] == 1e-4
    assert certificate["versions"]["torch"] and certificate["speed_vs_reference"]["llm"] > 0
    assert "verdict: certified" in report


#: mutant backend class -> (certify arguments that reach its fault, the check that must fail, words its detail names)
MUTANTS = {
    "Bf16Linear": (["--checks", "train"], "train (1 process)", "parts at step"),
    "Bf16Attention": (["--checks", "train"], "train (1 process)", "parts at step"),
    "MisscaledAttention": (["--checks", "train"], "train (1 process)", "parts at step 1: loss"),
    "NormEpsilon": (["--checks", "modules"], "modules (one batch)",
                     "forward output of decoder.layers.0.input_layernorm"),
    "NonCausalAttention": (["--checks", "modules"], "modules (one batch)",
                   "forward output of decoder.layers.0.self_attention.core_attention"),
    # wrong backwards: the first gradient the backward pass gets wrong, nearest the output
    "SwiGLUBackward": (["--checks", "modules"], "modules (one batch)", "gradient of decoder.layers.3.mlp.linear_fc1"),
    "NormBackward": (["--checks", "modules"], "modules (one batch)", "gradient of decoder.layers.3.mlp.linear_fc2"),
    "FrozenEmbedding": (["--checks", "modules"], "modules (one batch)",
                         "gradient of embedding.word_embeddings.weight: only in run A"),
    "DroppedClipPatch": (["--checks", "train"], "train (1 process)", "the run failed"),
    "SkippedReduction": (["--checks", "layouts", "--layouts", "tp2"], "layout tp2", "parts at step 1"),
    "SummedNotAveraged": (["--checks", "layouts", "--layouts", "dp2"], "layout dp2", "parts at step 1"),
}  # TorchRMSNormEpsilon breaks a kernel only the task recipes call: test_a_kernel_fault_in_task_models_...


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_mutant_backend_fails_at_its_check(mutant, cpu_certificate, tmp_path):
    reference_dir, status, _, _ = cpu_certificate
    assert status == 0
    workdir = tmp_path / "certify"
    shutil.copytree(reference_dir / "llm" / "reference", workdir / "llm" / "reference")  # the reference, trained once,
    shutil.copy(reference_dir / "llm" / "trace-reference-on-cpu.safetensors", workdir / "llm")  # and traced once
    args, check, words = MUTANTS[mutant]
    status, certificate, report = certify("--device", f"mutant_backends:{mutant}", "--recipes", "llm", *args,
                                          workdir=workdir)
    assert status == 1, report
    failed = [c for c in certificate["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == [check], report
    assert words in failed[0]["detail"], failed[0]["detail"]
    assert "llm: reference: reusing" in report  # the mutant never trained its own reference


def test_every_installed_recipe_certifies_the_cpu(tmp_path):
    """Each recipe the plugins register (VLM, diffusion, policy) and core's MoE runs through certify: its reference
    and the device's run, compared step by step (short: 2 steps). The layout, resume, portability and module checks
    are the same code for every recipe and run for llm above (modules also for the task recipes, below); each
    recipe's layouts are held to one process by its own parity tests (tests/*/test_*parallel*.py), so they are not
    launched again here -- 4 two-process runs, over a minute of CI."""
    status, certificate, report = certify("--device", "cpu", "--recipes", "llm-moe", "vlm", "diffusion", "embodied",
                                          "--steps", "2", "--checks", "train", workdir=tmp_path)
    assert status == 0, report
    assert not certificate["complete"]  # --checks narrowed it
    ran = [(check["recipe"], check["name"]) for check in certificate["checks"]]
    assert ran == [(recipe, "train (1 process)") for recipe in ("llm-moe", "vlm", "diffusion", "embodied")]
    assert all(check["measured"] == 0.0 for check in certificate["checks"]), report  # the CPU against itself


def test_a_kernel_fault_in_task_models_is_named_at_its_module(tmp_path):
    """The task-engine recipes (a DiT, a policy) are traced too, through their tasks' deterministic losses: an RMSNorm
    kernel with the wrong epsilon, which megatron's layers never call, is named at the first module that calls it in
    each -- in the DiT where two training steps do not even show it."""
    status, certificate, report = certify("--device", "mutant_backends:TorchRMSNormEpsilon", "--recipes", "diffusion",
                                          "embodied", "--steps", "2", "--checks", "train", "modules",
                                          workdir=tmp_path)
    assert status == 1, report
    checks = {(check["recipe"], check["name"]): check for check in certificate["checks"]}
    assert checks[("diffusion", "train (1 process)")]["passed"]
    for recipe, module in (("diffusion", "text_in.norm"), ("embodied", "vision.0.stream.norm1")):
        modules = checks[(recipe, "modules (one batch)")]
        assert not modules["passed"] and f"forward output of {module}:" in modules["detail"], modules
