"""``training.compile: regional`` on a policy: the task engine compiles the policy's layers (its vision layer and
joint layers) and the run trains the same steps as in eager mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.testing.runs import step_losses, train

pytestmark = [pytest.mark.needs_plugins]

ROOT = Path(__file__).resolve().parents[2]
#: Three steps of the tiny Pi0.5 with three joint layers, no held-out scoring afterwards.
SMALL = ["model.overrides={text_len: 24, depth: 3}", "logging.progress=false", "logging.tensorboard=false",
         "logging.interval=1", "training.threads=1",
         "training.steps=3", "training.micro_batch_size=4", "checkpoint.interval=0", "checkpoint.save_at_end=false",
         "task.synthetic={episodes: 4, length: 8, seed: 0}", "task.held_out_episodes=1", "task.eval={frames: 0}"]


def _run(tmp_path: Path, name: str, *overrides: str) -> dict:
    return train(ROOT / "configs/embodied-tiny.yaml", tmp_path / name, [*SMALL, *overrides])


@pytest.mark.slow
def test_regional_compile_trains_the_same_steps_as_eager(tmp_path, capsys):
    eager = _run(tmp_path, "eager")
    compiled = _run(tmp_path, "regional", "training.compile=regional")
    assert eager["compile"] == "off"
    assert compiled["compile"] == "regional"
    assert compiled["compiled_modules"] == {"VisionLayer": 1, "JointLayer": 3}
    # one graph per kind of block: the vision layer's, the one the first two joint layers share, and the last joint
    # layer's, which has no prefix outputs (nothing reads them) and so is a different module
    assert compiled["compile_graphs"] == 3 and compiled["compile_s"] > 0
    assert "training.compile regional: 1 VisionLayer, 3 JointLayer compiled in" in capsys.readouterr().out
    ours, reference = step_losses(tmp_path / "regional"), step_losses(tmp_path / "eager")
    assert len(ours) == len(reference) == 3
    assert ours == pytest.approx(reference, rel=1e-4, abs=1e-6)
