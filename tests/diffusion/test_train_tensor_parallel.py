"""FSDP2 x tensor parallel x Ulysses context parallel trains the Wan DiT exactly like one process (fp32, gloo, CPU).

One ``loongforge train --nproc 4`` run lays the moving-squares DiT out as ``parallel.strategy=fsdp2 parallel.tp=2
parallel.cp=2`` with activation recompute on: each block's heads and FFN columns split over 2 tensor-parallel ranks
(DTensor: fused qkv/kv projections, the distributed q/k RMSNorm, row-parallel outputs), each rank's heads split
again by Ulysses over 2 context-parallel ranks, and FSDP2 sharding every slice over the 2 ranks that hold it. Per
step loss and gradient norm must match the single-process run within 1e-5 relative over 8 steps, and the final
checkpoint (full tensors gathered from the 2-D sharded DTensors) must hold the single-process weights -- a loss
alone would not catch a wrong gradient that AdamW's scale invariance hides. ``loongforge check`` refuses the
combinations that are not supported, in one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge.cli import main
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/diffusion-moving-squares.yaml")
STEPS, GLOBAL_BATCH, RTOL = 8, 8, 1e-5
COMMON = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "task.samples=64",
          "task.sample={videos: 0}", f"training.steps={STEPS}", "logging.interval=1", "scheduler.warmup_steps=2",
          f"scheduler.decay_steps={STEPS}", "task.ema=null", "task.recompute=true", "model.overrides.num_layers=2",
          f"training.micro_batch_size={GLOBAL_BATCH}"]


def start(out: Path, *overrides: str, nproc: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loongforge.cli", "train", CONFIG, f"run.output_dir={out}", *COMMON, *overrides,
           *(["--nproc", str(nproc)] if nproc > 1 else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finished(run: subprocess.Popen, out: Path) -> tuple[dict, dict]:
    """Per-step metrics rows and the final checkpoint's weights of a run started by :func:`start`."""
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-6000:]
    rows = {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    return rows, load_file(out / "checkpoints" / f"step-{STEPS:07d}" / "model.safetensors")


def test_fsdp2_tp2_cp2_matches_one_process(tmp_path):
    # both at once: most of either run's time is process start-up, which overlaps
    layout = start(tmp_path / "tp-cp", "parallel.strategy=fsdp2", "parallel.tp=2", "parallel.cp=2", nproc=4)
    single = start(tmp_path / "single")
    reference, reference_weights = finished(single, tmp_path / "single")
    rows, weights = finished(layout, tmp_path / "tp-cp")
    assert reference[STEPS]["loss"] < reference[1]["loss"]  # it learns: the comparison is not of constants
    assert sorted(rows) == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        worst = max(abs(rows[s][key] - reference[s][key]) / abs(reference[s][key]) for s in reference)
        assert worst <= RTOL, f"{key}: max relative difference {worst:.3g}"
    assert weights.keys() == reference_weights.keys()
    for name, expected in reference_weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("overrides,nproc,message", [
    (["parallel.strategy=ddp", "parallel.tp=2"], 2, "parallel.tp=2 with 'ddp'"),
    (["parallel.strategy=fsdp2", "parallel.tp=2", "parallel.cp=2", "model.overrides.num_heads=2"], 4,
     "must divide the model's num_heads (2)"),
    (["parallel.strategy=fsdp2", "parallel.tp=2", "task.lora={rank: 4}"], 2, "task.lora with parallel.tp=2"),
])
def test_check_refuses_unsupported_tensor_parallel(capsys, overrides, nproc, message):
    assert main(["check", CONFIG, "task.ema=null", *overrides, "--nproc", str(nproc)]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_check_refuses_tp_for_a_task_without_it(capsys):
    config = str(ROOT / "configs/diffusion-squares-image.yaml")
    assert main(["check", config, "parallel.strategy=fsdp2", "parallel.tp=2", "--nproc", "2"]) != 0
    assert "does not support tensor parallelism" in capsys.readouterr().err
