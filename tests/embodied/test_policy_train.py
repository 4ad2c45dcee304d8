"""``loongforge train configs/embodied-tiny.yaml`` end to end on a few-episode synthetic reach set: the loss falls,
a checkpoint resumes bit-exactly, the held-out evaluation is written, and DDP/ZeRO-1/FSDP2 (2 processes) and HSDP (4)
match one process (per-sample noise and time come from (seed, step, dataset index), so the layout does not change
the run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
#: A small model and data set: CLI runs of a few seconds each on a shared 2-core machine.
COMMON = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "logging.interval=1",
          "model.overrides={text_len: 24, depth: 1, vision_depth: 0}", "task.synthetic={episodes: 6, length: 8}",
          "task.held_out_episodes=2", "task.action_horizon=4", "task.eval={frames: 8, steps: 2}",
          "task.normalization=quantiles",
          "optimizer.lr=3e-3", "scheduler.warmup_steps=1", f"scheduler.decay_steps={STEPS}",
          "checkpoint.save_at_end=false"]


def train(out: Path, *overrides: str, nproc: int = 1) -> dict:
    cmd = [sys.executable, "-m", "loongforge.cli", "train", str(ROOT / "configs/embodied-tiny.yaml"),
           f"run.output_dir={out}", *COMMON, f"training.micro_batch_size={8 // nproc}", *overrides,
           *(["--nproc", str(nproc)] if nproc > 1 else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    return out, train(out, f"training.steps={STEPS}", f"checkpoint.interval={STEPS // 2}", "checkpoint.keep_last=2")


def test_loss_falls_and_evaluation_is_written(reference):
    out, rows = reference
    assert sorted(rows) == list(range(1, STEPS + 1))
    first, last = [rows[s]["loss"] for s in (1, 2)], [rows[s]["loss"] for s in (STEPS - 1, STEPS)]
    assert sum(last) < 0.8 * sum(first)
    scores = json.loads((out / "eval.json").read_text())
    assert scores["episodes"] == [4, 5] and scores["frames"] == 8
    assert set(scores["held_out_action_mse"]) == {"policy", "mean_baseline", "zero_baseline"}
    assert all(v > 0 for v in scores["held_out_action_mse"].values())


def test_resume_is_bit_exact(tmp_path, reference):
    """A fresh run resumed from the reference's mid-run checkpoint continues with identical numbers."""
    out, rows = reference
    resumed = train(tmp_path / "run", f"training.steps={STEPS}", "checkpoint.interval=0",
                    f"checkpoint.resume={out / 'checkpoints' / f'step-{STEPS // 2:07d}'}")
    assert sorted(resumed) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step]["loss"] == rows[step]["loss"] and resumed[step]["grad_norm"] == rows[step]["grad_norm"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "nproc", "extra"), [
    ("ddp", 2, []), ("zero1", 2, []), ("fsdp2", 2, []), ("hsdp", 4, ["parallel.fsdp_shard_size=2"]),
])
def test_torch_native_strategies_match_one_process(tmp_path, reference, strategy, nproc, extra):
    """DDP, ZeRO-1 and FSDP2 on 2 gloo ranks and HSDP (2 replicas x 2 shards) on 4 train the same run as one process:
    each rank takes its share of the global batch of 8, with the same per-sample noise and time."""
    _, rows = reference
    parallel = train(tmp_path / "run", f"training.steps={STEPS}", "checkpoint.interval=0",
                     f"parallel.strategy={strategy}", "task.eval={frames: 0}", *extra, nproc=nproc)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            assert abs(parallel[step][key] - rows[step][key]) <= 1e-5 * abs(rows[step][key]), (strategy, step, key)


@pytest.mark.parametrize("flavor", ["gr00t-tiny", "pi05-gemma-tiny"])
def test_other_policy_families_train_through_the_cli(tmp_path, flavor):
    """PolicyTask runs any flavor's protocol: GR00T's frame inputs (embodiment id) and time convention, the
    PaliGemma-exact Pi0.5's prompt ids with the binned state; the loss falls and the evaluation is written."""
    out = tmp_path / "run"
    rows = train(out, f"model.name={flavor}", "model.overrides={}", "training.steps=40", "scheduler.decay_steps=40",
                 "task.eval={frames: 8, steps: 4}")
    assert sorted(rows) == list(range(1, 41))
    losses = [rows[step]["loss"] for step in range(1, 41)]
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10]), losses
    assert (out / "eval.json").is_file()


def test_recompute_trains_the_same_run(tmp_path, reference):
    """``task.recompute: true`` (activation checkpointing of every layer) changes memory, not the numbers."""
    _, rows = reference
    recomputed = train(tmp_path / "run", f"training.steps={STEPS}", "checkpoint.interval=0", "task.recompute=true",
                       "task.eval={frames: 0}")
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            assert abs(recomputed[step][key] - rows[step][key]) <= 1e-6 * abs(rows[step][key]), (step, key)
