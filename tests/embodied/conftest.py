"""Meta-World fixtures shared by the closed-loop tests (``test_metaworld.py``, ``test_embodied_videos.py``):
expert episodes recorded by ``loongforge collect`` and a tiny state-only policy trained on them by ``loongforge
train``. Session-scoped, so a session that runs both files collects and trains once (~20 s on 2 CPU cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

#: The config the policy is trained with (a few steps of a tiny state-only pi0 on the recorded set).
CONFIG = """\
run: {name: mw-test, seed: 0}
model:
  name: pi0-tiny
  overrides: {cameras: 0, max_state_dim: 40, max_action_dim: 4, text_len: 16, depth: 1}
optimizer: {lr: 3.0e-3}
scheduler: {warmup_steps: 1, decay_steps: 4}
training: {steps: 4, micro_batch_size: 8, threads: 1}
checkpoint: {interval: 0, save_at_end: true}
logging: {interval: 1, progress: false, tensorboard: false}
task:
  held_out_episodes: 1
  action_horizon: 4
  normalization: mean_std
  eval: {frames: 4, steps: 2}
"""


@dataclass(frozen=True)
class RecordedSet:
    """Where ``loongforge collect`` wrote the expert episodes, its report, and the options it ran with."""

    root: Path
    report: object  # loongforge_embodied.sim.collect.CollectReport (imported with the simulator)
    env: str
    tail: int


@pytest.fixture(scope="session")
def metaworld_recorded(tmp_path_factory) -> RecordedSet:
    """Two successful reach-v3 expert episodes (seeds 0 and 1), cut 5 steps after success."""
    from loongforge.cli import main
    from loongforge_embodied.sim.collect import REPORT_PATH, CollectReport

    env, tail = "reach-v3", 5
    root = tmp_path_factory.mktemp("metaworld") / "reach"
    assert main(["collect", str(root), "--env", env, "--episodes", "2", "--max-steps", "150", "--tail", str(tail)]) == 0
    saved = json.loads((root / REPORT_PATH).read_text())
    report = CollectReport(**{field.name: saved[field.name] for field in fields(CollectReport)})
    return RecordedSet(root, report, env, tail)


@pytest.fixture(scope="session")
def metaworld_checkpoint(metaworld_recorded, tmp_path_factory) -> Path:
    """A tiny state-only policy (39 state values, 4 actions, horizon 4) trained 4 steps by ``loongforge train``."""
    out = tmp_path_factory.mktemp("mw-train")
    config = out / "mw.yaml"
    config.write_text(CONFIG)
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), f"run.output_dir={out}/run",
                           f"task.data={metaworld_recorded.root}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out / "run" / "checkpoints"
