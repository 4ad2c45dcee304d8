"""``logging.trackers``: W&B (offline), MLflow (a file store in the run) and CSV written by a real tiny run, each
holding the interval means of metrics.jsonl and the resolved config; pictures reaching TensorBoard, MLflow and
W&B with their captions (from a task engine's ``finish``, after the last step); one-line refusals; the summary
of a resumed run."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from loongforge import load_config
from loongforge.errors import ConfigError, LoongForgeError

#: A tiny LLM, 6 steps logged every 3: the trackers get the means of steps 1-3 and 4-6.
BASE = ["model.name=llama-debug", "data.seq_length=32", "training.micro_batch_size=2", "training.threads=1",
        "training.steps=6", "logging.interval=3", "logging.progress=false", "training.sample_tokens=0",
        "checkpoint.save_at_end=false", "checkpoint.interval=0"]


def _config(out: Path, *overrides: str):
    return load_config(None, [f"run.output_dir={out}", *BASE, *overrides])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _means(rows: list[dict], key: str, steps: range) -> float:
    values = [row[key] for row in rows if row["step"] in steps]
    return sum(values) / len(values)


def test_wandb_mlflow_and_csv_offline_hold_the_interval_means_and_the_config(tmp_path):
    from loongforge.train.run import run_training

    out = tmp_path / "run"
    summary = run_training(_config(out, "logging.trackers=[wandb,mlflow,csv]"), device="cpu")
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    mean_loss = {3: _means(rows, "loss", range(1, 4)), 6: _means(rows, "loss", range(4, 7))}
    assert list(summary["trackers"]) == ["wandb", "mlflow", "csv"] and summary["tensorboard_dir"] is None
    assert not (out / "tensorboard").exists()

    # csv: one row per logging step, a column per tag, the exact means (Python's float repr round-trips)
    with open(out / "metrics.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in table] == [3, 6]
    assert set(table[0]) == {"step", "train/loss", "train/lr", "train/grad_norm", "train/step_time",
                             "train/samples_per_s", "train/tokens_per_s", "train/tflops", "train/mfu"}
    assert [float(row["train/loss"]) for row in table] == pytest.approx([mean_loss[3], mean_loss[6]], rel=1e-12)
    assert float(table[1]["train/lr"]) == rows[5]["lr"]  # the logging step's own rate, not a mean
    assert float(table[0]["train/tokens_per_s"]) == pytest.approx(_means(rows, "tokens_per_s", range(1, 4)))

    # mlflow: a file store in the run; metrics/<group>/<name> holds "<timestamp> <value> <step>" lines
    (run_dir,) = [p for p in (out / "mlruns").glob("*/*") if (p / "meta.yaml").is_file()]
    lines = (run_dir / "metrics" / "train" / "loss").read_text().split("\n")
    logged = {int(step): float(value) for _, value, step in (line.split() for line in lines if line)}
    assert logged == pytest.approx(mean_loss, rel=1e-12)
    assert (run_dir / "params" / "training.steps").read_text() == "6"
    assert (run_dir / "params" / "model.name").read_text() == "llama-debug"
    assert (run_dir / "params" / "logging.trackers").read_text() == '["wandb", "mlflow", "csv"]'
    assert "status: 3" in (run_dir / "meta.yaml").read_text()  # FINISHED: the run was closed

    # wandb: an offline run, its records in run-<id>.wandb (history keys with JSON values, the config)
    (offline,) = (out / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")
    data = records.read_bytes()
    for text in ("train/loss", "train/tokens_per_s", "training.steps", "llama-debug", json.dumps(mean_loss[6])):
        assert text.encode() in data, text


def test_unknown_tracker_and_missing_package_are_one_line(monkeypatch):
    from loongforge.train.loop import validate_loop_settings

    config = load_config(None, ["logging.trackers=[tensorboard,neptune]"])
    with pytest.raises(ConfigError) as refused:
        validate_loop_settings(config)
    assert str(refused.value) == (f"{config.source}: logging.trackers: unknown tracker 'neptune'; known: csv, "
                                  "mlflow, tensorboard, wandb")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    config = load_config(None, ["logging.trackers=[csv,wandb]"])
    with pytest.raises(ConfigError) as refused:
        validate_loop_settings(config)
    assert str(refused.value) == (f"{config.source}: logging.trackers: 'wandb' needs the wandb package: "
                                  "pip install 'loongforge-core[wandb]'")


def test_logging_tensorboard_false_still_turns_tensorboard_off():
    from loongforge.train.trackers import tracker_names

    assert tracker_names(load_config(None)) == ["tensorboard"]
    assert tracker_names(load_config(None, ["logging.tensorboard=false"])) == []
    assert tracker_names(load_config(None, ["logging.tensorboard=false", "logging.trackers=[csv,tensorboard,csv]"])) \
        == ["csv"]


def _pictures():
    """Two 6x8 RGB images (red, green) and one 3-frame 4x4 grey video whose frames get brighter."""
    red, green = np.zeros((6, 8, 3), np.uint8), np.zeros((6, 8, 3), np.uint8)
    red[..., 0], green[..., 1] = 255, 255
    video = np.stack([np.full((4, 4, 1), level, np.uint8) for level in (0, 120, 240)])
    return [red, green], video


def test_finish_pictures_reach_every_tracker_with_captions_before_it_closes(tmp_path, monkeypatch):
    """What an engine's ``finish`` logs to ``trainer.media`` (a diffusion task's samples) lands in TensorBoard,
    MLflow and W&B: the run closes its trackers after ``finish``, not before."""
    from loongforge.train.engines.megatron import MegatronEngine
    from loongforge.train.run import run_training
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images, video = _pictures()
    original = MegatronEngine.finish

    def finish_with_pictures(self, trainer):
        trainer.media.images("samples", images, ["a red square", "a green square"], step=trainer.step)
        trainer.media.videos("rollouts", [video], ["getting brighter"], step=trainer.step, fps=4)
        return original(self, trainer)

    monkeypatch.setattr(MegatronEngine, "finish", finish_with_pictures)
    out = tmp_path / "run"
    run_training(_config(out, "logging.trackers=[tensorboard,mlflow,wandb,csv]", "training.steps=2"),
                 device="cpu")

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"samples/0", "samples/1", "rollouts/0"}
    first = Image.open(io.BytesIO(events.Images("samples/0")[0].encoded_image_string))
    assert first.size == (8, 6) and first.convert("RGB").getpixel((3, 3)) == (255, 0, 0)
    assert events.Images("samples/1")[0].step == 2
    gif = Image.open(io.BytesIO(events.Images("rollouts/0")[0].encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == 3 and gif.size == (4, 4)
    gif.seek(2)
    assert gif.convert("L").getpixel((1, 1)) == 240
    captions = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]
                if tag.startswith(("samples/", "rollouts/"))}
    assert captions == {"samples/0/text_summary": "a red square", "samples/1/text_summary": "a green square",
                        "rollouts/0/text_summary": "getting brighter"}
    assert "config/text_summary" in events.Tags()["tensors"]  # the resolved config as a table

    (run_dir,) = [p for p in (out / "mlruns").glob("*/*") if (p / "meta.yaml").is_file()]
    artifacts = run_dir / "artifacts"
    assert json.loads((artifacts / "samples" / "step000002-captions.json").read_text()) == {
        "step000002-000.png": "a red square", "step000002-001.png": "a green square"}
    assert Image.open(artifacts / "samples" / "step000002-001.png").convert("RGB").getpixel((0, 0)) == (0, 255, 0)
    assert json.loads((artifacts / "rollouts" / "step000002-captions.json").read_text()) == {
        "step000002-000.gif": "getting brighter"}
    assert Image.open(artifacts / "rollouts" / "step000002-000.gif").n_frames == 3

    (offline,) = (out / "wandb").glob("offline-run-*")
    data = next(offline.glob("run-*.wandb")).read_bytes()
    assert b"a red square" in data and b"getting brighter" in data
    assert len(list((offline / "files" / "media").rglob("*.png"))) == 2
    assert len(list((offline / "files" / "media").rglob("*.gif"))) == 1


def test_bad_pictures_are_refused_in_one_line():
    from loongforge.train.trackers import Trackers

    media = Trackers()
    images, video = _pictures()
    with pytest.raises(LoongForgeError, match=r"^media 'samples' image 1: expected a uint8 H x W x C array with C "
                                              r"in 1, 3, 4; got float32 of shape \(6, 8, 3\)$"):
        media.images("samples", [images[0], images[1].astype(np.float32)], ["a", "b"], step=1)
    with pytest.raises(LoongForgeError, match=r"^media 'samples': 2 images but 1 captions$"):
        media.images("samples", images, ["a"], step=1)
    with pytest.raises(LoongForgeError, match=r"^media 'rollouts' video 0: expected a uint8 T x H x W x C array"):
        media.videos("rollouts", [video[0]], ["a"], step=1, fps=4)
    with pytest.raises(LoongForgeError, match=r"^media 'rollouts': fps must be an integer >= 1, got 0$"):
        media.videos("rollouts", [video], ["a"], step=1, fps=0)


def test_a_resumed_run_reports_its_own_steps_and_keeps_each_csv_row_once(tmp_path, capsys):
    """A run killed after logging step 6 but with its newest checkpoint at step 4 (checkpoint.interval=4, no save
    at the end) resumes at 4: the summary counts the 2 steps this process trained and the CSV drops the old row 6."""
    from loongforge.train.run import run_training

    out = tmp_path / "run"
    settings = ["logging.trackers=[csv]", "logging.interval=2", "checkpoint.interval=4"]
    first = run_training(_config(out, *settings), device="cpu")
    assert (first["steps"], first["steps_this_run"]) == (6, 6)
    assert "done: 6 steps, loss" in capsys.readouterr().out
    second = run_training(_config(out, *settings), device="cpu")
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert (second["steps"], second["steps_this_run"], second["steps_total"]) == (6, 2, 6)
    assert second["first_loss"] == rows[4]["loss"] and second["final_loss"] == rows[5]["loss"]
    printed = capsys.readouterr().out
    assert (f"done: 2 steps this run (6 of 6 total), loss {rows[4]['loss']:.4f} -> {rows[5]['loss']:.4f}, "
            in printed)
    with open(out / "metrics.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in table] == [2, 4, 6]
    assert float(table[2]["train/loss"]) == pytest.approx(_means(rows, "loss", range(5, 7)), rel=1e-12)
