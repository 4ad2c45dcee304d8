"""Every parallel layout reproduces the single-process run: per-step loss and grad norm within 1e-5 (fp32, gloo).

Each layout trains the same 4-layer ``llama-debug`` for 10 steps on the same data and seed through the real
CLI: ``loongforge train --nproc 2`` (one layout through plain ``torchrun`` instead). The single-process
reference runs 2 micro-batches per step (global batch 4 = 2 x micro-batch 2), so dp=2 compares one micro-batch
per rank against gradient accumulation. Checkpoints written at one layout resume at another: the remaining
losses must match the uninterrupted reference, and bit for bit when the layout is unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG = """
run: {output_dir: OUT, seed: 11}
model: {name: llama-debug, overrides: {num_layers: 4}}
data: {seq_length: 32}
optimizer: {lr: 0.002}
scheduler: {warmup_steps: 2}
training: {steps: 10, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {save_at_end: false, resume: never, keep_last: 0}
logging: {interval: 10, progress: false, tensorboard: false}
"""
STEPS = 10
RTOL = 1e-5


def train(
    root: Path, name: str, *overrides: str, nproc: int = 1, torchrun: bool = False, config_text: str = CONFIG
) -> tuple[dict, str]:
    """Run the CLI for one layout (``config_text``: a YAML template with ``OUT`` for the output directory);
    return ``({step: metrics row}, stdout)``."""
    out = root / name
    config = root / f"{name}.yaml"
    config.write_text(config_text.replace("OUT", str(out)))
    cli = ["train", str(config), *overrides]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "loongforge.cli", *cli]
    else:
        cmd = [sys.executable, "-m", "loongforge.cli", *cli, *(["--nproc", str(nproc)] if nproc > 1 else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}, done.stdout


def max_rel_diff(rows: dict, reference: dict, key: str) -> float:
    return max(abs(row[key] - reference[step][key]) / abs(reference[step][key]) for step, row in rows.items())


def assert_parity(rows: dict, reference: dict, steps: range, rtol: float = RTOL) -> None:
    assert sorted(rows) == list(steps)
    for key in ("loss", "grad_norm"):
        diff = max_rel_diff(rows, reference, key)
        assert diff <= rtol, f"{key}: max relative difference {diff:.3g} > {rtol:g}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def reference(root):
    rows, stdout = train(root, "single")
    assert "tp=1 pp=1 dp=1" in stdout and "2 micro-batches/step" in stdout
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.05  # it learns: the comparison is not of constants
    return rows


@pytest.fixture(scope="module")
def dp2_distributed_optimizer(root):
    """dp=2 with the distributed optimizer, checkpointing at step 5 (reused by the resume tests)."""
    rows, stdout = train(
        root, "dp2-distopt", "parallel.distributed_optimizer=true", "checkpoint.interval=5", nproc=2
    )
    assert "dp=2" in stdout and "1 micro-batches/step" in stdout
    return rows, root / "dp2-distopt" / "checkpoints" / "step-0000005"


LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "dp2": [],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(root, reference, name):
    rows, stdout = train(root, name, *LAYOUTS[name], nproc=2, torchrun=name == "tp2")
    assert "world size 2" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))


def test_dp2_distributed_optimizer_matches_single_process(reference, dp2_distributed_optimizer):
    rows, _ = dp2_distributed_optimizer
    assert_parity(rows, reference, range(1, STEPS + 1))


def test_distributed_optimizer_resume_same_layout_is_bit_exact(root, dp2_distributed_optimizer):
    uninterrupted, checkpoint = dp2_distributed_optimizer
    rows, stdout = train(
        root, "dp2-distopt-resumed", "parallel.distributed_optimizer=true", f"checkpoint.resume={checkpoint}",
        nproc=2,
    )
    assert "at step 5" in stdout
    assert sorted(rows) == list(range(6, STEPS + 1))
    assert [rows[s]["loss"] for s in rows] == [uninterrupted[s]["loss"] for s in rows]
    assert [rows[s]["grad_norm"] for s in rows] == [uninterrupted[s]["grad_norm"] for s in rows]


def test_distributed_optimizer_checkpoint_resumes_in_one_process(root, reference, dp2_distributed_optimizer):
    """dp=2 + distributed optimizer -> one process with the plain optimizer: Adam state is whole again."""
    _, checkpoint = dp2_distributed_optimizer
    rows, stdout = train(root, "single-from-dp2", f"checkpoint.resume={checkpoint}")
    assert "at step 5" in stdout
    assert_parity(rows, reference, range(6, STEPS + 1), rtol=1e-6)


def test_tp2_pp2_matches_and_resumes_at_dp2(root, reference):
    """Four processes (tp=2 x pp=2, distributed optimizer), then its step-5 checkpoint at tp=1, pp=1, dp=2."""
    rows, stdout = train(
        root, "tp2-pp2", "parallel.tp=2", "parallel.pp=2", "parallel.distributed_optimizer=true",
        "checkpoint.interval=5", nproc=4,
    )
    assert "tp=2 pp=2 dp=1" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))
    checkpoint = root / "tp2-pp2" / "checkpoints" / "step-0000005"
    resumed, stdout = train(
        root, "dp2-from-tp2-pp2", "parallel.distributed_optimizer=true", f"checkpoint.resume={checkpoint}", nproc=2
    )
    assert "at step 5" in stdout and "dp=2" in stdout
    assert_parity(resumed, reference, range(6, STEPS + 1), rtol=1e-6)
    assert_parity(resumed, rows, range(6, STEPS + 1), rtol=1e-6)


def test_torchrun_layout_error_is_printed_once(root):
    """A layout error found in the ranks themselves (3 layers over pp=2) is printed by rank 0 alone."""
    config = root / "bad.yaml"
    config.write_text(CONFIG.replace("OUT", str(root / "bad")))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "loongforge.cli", "train", str(config), "model.overrides.num_layers=3", "parallel.pp=2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {config}: the model's 3 layers do not split into pp*vpp=2*1 = 2 equal stages"]
