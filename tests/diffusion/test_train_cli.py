"""``loongforge train`` runs a Wan DiT through core's task loop: loss falls, samples are written as GIFs and
scored, and a resumed run continues bit-exactly (model, optimizer, schedule, data order, the task's RNG)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loongforge import load_config
from loongforge.cli import main
from loongforge.errors import ConfigError
from loongforge.train.run import run_training
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/diffusion-moving-squares.yaml"
SMALL = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "task.samples=256",
         "task.sample={videos: 2, steps: 3}"]


def _config(tmp_path, name, *overrides):
    return load_config(str(ROOT / CONFIG), [f"run.output_dir={tmp_path / name}", *SMALL, *overrides])


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def test_train_samples_gifs_and_resumes_bit_exactly(tmp_path):
    straight = run_training(_config(tmp_path, "straight", "training.steps=8", "checkpoint.interval=0"))
    assert straight["final_loss"] < straight["first_loss"]
    gifs = sorted((tmp_path / "straight" / "samples").glob("*.gif"))
    assert len(gifs) == 2 and Image.open(gifs[0]).n_frames == 4
    assert set(straight["sample_scores"]) == {"colour", "direction", "square"}

    run_training(_config(tmp_path, "resumed", "training.steps=5", "checkpoint.interval=5"))
    resumed = run_training(_config(tmp_path, "resumed", "training.steps=8", "checkpoint.interval=0"))
    assert resumed["steps"] == 8
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # bit-exact after the resume at 5


def test_bad_task_options_are_one_line_errors(tmp_path, capsys):
    config = str(ROOT / CONFIG)
    assert main(["train", config, f"run.output_dir={tmp_path}", "task.smaples=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task in" in err and "unknown key(s) smaples; known: data, samples" in err
    with pytest.raises(ConfigError, match="task options \\['samples'\\] are set but model 'llama-debug' has no task"):
        run_training(load_config(None, ["model.name=llama-debug", "task.samples=3", f"run.output_dir={tmp_path}"]))
