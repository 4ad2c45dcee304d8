"""``loongforge train`` runs the Qwen-Image MMDiT on still squares (text-to-image, pixel space): loss falls, PNGs
are written and scored for colour and square-ness (no direction: one frame cannot show one), a resumed run (EMA
included) continues bit-exactly, ``loongforge sample`` writes PNGs, ``task.init`` reads our checkpoints and
diffusers' layout, a 2-rank ddp run equals one process, and bad options are one-line errors naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge import load_config
from loongforge.cli import main
from loongforge.errors import ConfigError
from loongforge_diffusion.data.moving_squares import caption, parse_caption
from loongforge_diffusion.data.still_squares import StillSquares
from loongforge_diffusion.qwen_image.diffusers_adapter import to_diffusers
from loongforge_diffusion.scoring import score_videos
from PIL import Image
from safetensors.torch import load_file, save_file
from test_train_parallel import assert_same_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/diffusion-squares-image.yaml")
SMALL = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "task.samples=64",
         "training.micro_batch_size=8", "logging.interval=1", "scheduler.warmup_steps=2", "scheduler.decay_steps=8",
         "model.overrides.num_layers=2"]


def train(out: Path, *overrides: str) -> int:
    return main(["train", CONFIG, f"run.output_dir={out}", *SMALL, *overrides])


def rows_of(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def test_train_writes_scored_pngs_and_resumes_bit_exactly(tmp_path):
    ema = "task.ema={decay: 0.9, warmup: false}"
    assert train(tmp_path / "straight", "training.steps=8", "checkpoint.interval=0", ema,
                 "task.sample={images: 2, steps: 3}") == 0
    straight = rows_of(tmp_path / "straight")
    assert straight[8]["loss"] < 0.9 * straight[1]["loss"]
    pngs = sorted((tmp_path / "straight" / "samples").glob("sample-*.png"))
    assert len(pngs) == 2 and Image.open(pngs[0]).size == (128, 128)

    assert train(tmp_path / "resumed", "training.steps=5", "checkpoint.interval=5", ema, "task.sample={images: 0}") == 0
    assert train(tmp_path / "resumed", "training.steps=8", "checkpoint.interval=0", ema, "task.sample={images: 0}") == 0
    resumed = rows_of(tmp_path / "resumed")
    for step in range(1, 9):  # bit-exact after the resume at step 5
        assert {k: resumed[step][k] for k in ("loss", "grad_norm", "lr")} == \
            {k: straight[step][k] for k in ("loss", "grad_norm", "lr")}, step
    final = [load_file(str(tmp_path / run / "checkpoints" / "step-0000008" / "model.safetensors"))
             for run in ("straight", "resumed")]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])
    averages = [torch.load(tmp_path / run / "checkpoints" / "step-0000008" / "state.pt")["task"]["ema"]
                for run in ("straight", "resumed")]
    assert averages[0]["num_updates"] == averages[1]["num_updates"] == 8
    assert all(torch.equal(averages[0]["shadow"][n], averages[1]["shadow"][n]) for n in averages[0]["shadow"])


def test_sample_command_writes_pngs_and_init_reads_both_layouts(tmp_path, capsys):
    assert train(tmp_path / "run", "training.steps=2", "task.sample={images: 0}") == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    args = ["sample", str(checkpoints), "--steps", "2", "--out", str(tmp_path / "png"), "--format", "png"]
    assert main(args + ["--prompt", "a red square of size 4", "--prompt", "blue 3"]) == 0
    assert "sample-000.png  <- 'a red square of size 4'" in capsys.readouterr().out
    image = Image.open(tmp_path / "png" / "sample-001.png")
    assert image.format == "PNG" and image.size == (128, 128)

    assert main(["sample", str(checkpoints), "--prompt", "a red square of size 4 moving right"]) == 2
    assert "names a direction, but this model draws still images" in capsys.readouterr().err
    assert main(["sample", str(checkpoints), "--prompt", "red 4", "--format", "mp4"]) == 2
    assert "not an image format; use one of png, gif" in capsys.readouterr().err

    # task.init: our checkpoint, or the same weights under diffusers' names (a released transformer directory)
    ours = load_file(str(checkpoints / "step-0000002" / "model.safetensors"))
    config = load_config(CONFIG, [*SMALL, f"task.init={checkpoints / 'step-0000002'}"])
    task = config_task(config)
    released = tmp_path / "released" / "transformer"
    released.mkdir(parents=True)
    save_file(to_diffusers(ours, task.flavor), str(released / "diffusion_pytorch_model.safetensors"))
    for init in (checkpoints / "step-0000002", released.parent):
        model = config_task(load_config(CONFIG, [*SMALL, f"task.init={init}"])).build_model()
        assert all(torch.equal(t, ours[name]) for name, t in model.state_dict().items())
    with pytest.raises(ConfigError, match="neither a LoongForge checkpoint"):
        config_task(load_config(CONFIG, [*SMALL, f"task.init={tmp_path}"])).build_model()


def config_task(config):
    from loongforge.plugins import get_host

    return get_host().registry("model").load(config.model.name, where="test").make_task(config)


@pytest.mark.parametrize("override,message", [
    ("task.smaples=3", "{cli}: unknown key 'task.smaples' (known keys here: samples, side"),
    ("task.sample={videos: 2}", "{cli}: unknown key 'task.sample.videos' (known keys here: images"),
    ("task.ema={decy: 0.9}",
     "{cli}: unknown key 'task.ema.decy' (known keys here: decay, warmup); did you mean 'decay'?"),
    ("task.flow_matching={shfit: 2}", "{cli}: unknown key 'task.flow_matching.shfit' (known keys here: shift"),
    ("task.context_dropout=lots", "{cli}: 'task.context_dropout' must be a number, got 'lots'"),
    ("model.overrides.in_channels=16", "pixel-space training needs in_channels 12 (RGB in 2x2 patches)"),
    ("task.side=15", "task.side 15 in {config} must be a multiple of the patch size 2"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, override, message):
    assert main(["train", CONFIG, f"run.output_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(config=CONFIG, cli=f"command line ({override})") in err, err


def test_still_captions_and_scores_have_no_direction():
    labels = torch.tensor([0, 3, 1])
    assert caption(labels, moving=False) == "a red square of size 4"
    assert parse_caption("a red square of size 4", moving=False).tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="must name exactly one size"):
        parse_caption("a red square", moving=False)
    data = StillSquares(8, text_dim=32, seed=0, side=16)
    item = data[5]
    assert item["image"].shape == (3, 16, 16) and item["context"].shape == (2, 32)
    images = torch.stack([data[i]["image"] for i in range(8)])[:, :, None]  # (B, 3, 1, H, W)
    labels = torch.stack([data[i]["labels"] for i in range(8)])
    assert score_videos(images, labels) == {"colour": 1.0, "square": 1.0}  # the training images score perfectly
    assert score_videos(-torch.ones_like(images), labels) == {"colour": 0.0, "square": 0.0}


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_ranks_equal_one_process(tmp_path):
    steps = 4
    common = [*SMALL, f"training.steps={steps}", "checkpoint.save_at_end=false", "task.sample={images: 0}",
              f"scheduler.decay_steps={steps}"]

    def run(out: Path, *extra: str) -> dict:
        cmd = [sys.executable, "-m", "loongforge.cli", "train", CONFIG, f"run.output_dir={out}", *common, *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return rows_of(out)

    single = run(tmp_path / "single")
    assert single[steps]["loss"] < single[1]["loss"]
    ddp = run(tmp_path / "ddp", "training.micro_batch_size=4", "parallel.strategy=ddp", "--nproc", "2")
    assert_same_run(ddp, single, range(1, steps + 1))
