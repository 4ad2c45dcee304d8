"""``loongforge train`` runs a Wan DiT through core's task loop: loss falls, samples are written as GIFs and
scored, and a resumed run continues bit-exactly (model, optimizer, schedule, data order, the task's RNG)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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
    gifs = sorted((tmp_path / "straight" / "samples").glob("sample-*.gif"))
    assert len(gifs) == 2 and Image.open(gifs[0]).n_frames == 4
    assert set(straight["sample_scores"]) == {"colour", "direction", "square"}

    run_training(_config(tmp_path, "resumed", "training.steps=5", "checkpoint.interval=5"))
    resumed = run_training(_config(tmp_path, "resumed", "training.steps=8", "checkpoint.interval=0"))
    assert resumed["steps"] == 8
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # bit-exact after the resume at 5


def test_sample_command_writes_gif_mp4_and_png(tmp_path, capsys):
    import av

    run_training(_config(tmp_path, "run", "training.steps=2", "task.sample={videos: 0}"))
    checkpoints = tmp_path / "run" / "checkpoints"
    prompts = ["a red square of size 4 moving right", "blue 3 up"]
    for fmt in ("gif", "mp4", "png"):
        args = ["sample", str(checkpoints), "--steps", "2", "--out", str(tmp_path / fmt), "--format", fmt]
        assert main(args + [arg for p in prompts for arg in ("--prompt", p)]) == 0
    out = capsys.readouterr().out
    assert "sample-000.gif  <- 'a red square of size 4 moving right'" in out
    side = 8 * load_config(ROOT / CONFIG).task["side"]  # frames are enlarged 8x
    assert Image.open(tmp_path / "gif" / "sample-001.gif").size == (side, side)
    with av.open(str(tmp_path / "mp4" / "sample-000.mp4")) as video:
        assert video.streams.video[0].codec_context.name == "h264" and len(list(video.decode(video=0))) == 4
    assert len(list((tmp_path / "png" / "sample-001").glob("frame-*.png"))) == 4

    assert main(["sample", str(checkpoints), "--prompt", "a purple square"]) == 2
    assert "must name exactly one colour" in capsys.readouterr().err


def test_bad_task_options_are_one_line_errors(tmp_path, capsys):
    config = str(ROOT / CONFIG)
    assert main(["train", config, f"run.output_dir={tmp_path}", "task.smaples=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "command line (task.smaples=3): unknown key 'task.smaples' (known keys here: data, samples" in err
    assert "did you mean 'samples'?" in err
    assert main(["train", config, f"run.output_dir={tmp_path}", "task.side=8"]) == 2  # too small for the motion
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task.frames/side/speed: " in err and "cannot travel 3 steps" in err, err
    with pytest.raises(ConfigError, match=r"unknown key 'task.samples' \(model 'llama-debug' takes no task: section"):
        run_training(load_config(None, ["model.name=llama-debug", "task.samples=3", f"run.output_dir={tmp_path}"]))


def test_lora_fine_tune_with_ema_from_a_checkpoint_resumes_bit_exactly(tmp_path):
    from safetensors.torch import load_file

    run_training(_config(tmp_path, "base", "training.steps=3", "task.sample={videos: 0}"))
    base = tmp_path / "base" / "checkpoints" / "step-0000003"
    tune = [f"task.init={base}", "task.lora={rank: 4, alpha: 8}", "task.ema={decay: 0.9, warmup: false}",
            "task.recompute=true", "task.sample={videos: 1, steps: 2}"]
    straight = run_training(_config(tmp_path, "tune", "training.steps=4", *tune))
    assert "sample_scores" in straight  # sampled with the EMA weights
    weights, start = load_file(tmp_path / "tune" / "checkpoints" / "step-0000004" / "model.safetensors"), \
        load_file(base / "model.safetensors")
    adapters = [name for name in weights if ".lora_" in name]
    assert adapters and all(torch.equal(weights[k], start[k]) for k in start)  # the base stayed frozen
    optim = torch.load(tmp_path / "tune" / "checkpoints" / "step-0000004" / "optimizer.pt", weights_only=True)
    assert sorted(optim["state"]) == sorted(adapters)  # only adapters were trained
    state = torch.load(tmp_path / "tune" / "checkpoints" / "step-0000004" / "state.pt", weights_only=True)
    assert sorted(state["task"]["ema"]["shadow"]) == sorted(adapters)

    run_training(_config(tmp_path, "tune2", "training.steps=2", "checkpoint.interval=2", *tune))
    resumed = run_training(_config(tmp_path, "tune2", "training.steps=4", *tune))
    assert _losses(tmp_path / "tune2") == _losses(tmp_path / "tune")
    assert resumed["sample_scores"] == straight["sample_scores"]
