"""``loongforge plot``: two real tiny runs drawn into one PNG of the documented size, every subplot holding both
runs' lines; refusals in one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from loongforge import load_config
from loongforge.cli import main

#: matplotlib's first two line colours: run 1 and run 2.
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from loongforge.train.run import run_training

    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("fast", "3e-3"), ("slow", "3e-4")):
        run_training(load_config(None, [
            f"run.output_dir={root / name}", "model.name=llama-debug", "data.seq_length=32",
            "training.micro_batch_size=2", "training.threads=1", "training.steps=6", "logging.interval=2",
            "logging.progress=false", "logging.trackers=[]", "training.sample_tokens=0", "checkpoint.interval=0",
            "checkpoint.save_at_end=false", f"optimizer.lr={lr}", "scheduler.warmup_steps=2"]), device="cpu")
    return root / "fast", root / "slow"


def _near(pixels: np.ndarray, colour: tuple[int, int, int]) -> int:
    return int((np.abs(pixels[..., :3].astype(int) - colour).sum(axis=-1) < 40).sum())


def test_two_runs_make_one_png_with_both_lines_in_every_subplot(two_runs, tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "plots" / "curves.png"
    assert main(["plot", *map(str, two_runs), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: loss, lr, grad_norm, tokens_per_s of 2 run(s)\n"
    image = Image.open(out)
    assert image.format == "PNG" and image.size == (2 * 640, 2 * 360)  # 2 x 2 subplots of 6.4 x 3.6 in at 100 dpi
    pixels = np.asarray(image.convert("RGB"))
    for row in range(2):
        for column in range(2):
            cell = pixels[row * 360:(row + 1) * 360, column * 640:(column + 1) * 640]
            # both lines (far more pixels than a legend's sample line) on a white background
            assert _near(cell, BLUE) > 150 and _near(cell, ORANGE) > 150, (row, column)
            assert _near(cell, (255, 255, 255)) > cell.shape[0] * cell.shape[1] // 2


def test_chosen_metrics_give_one_subplot_each(two_runs, tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "loss.png"
    assert main(["plot", str(two_runs[0]), "--out", str(out), "--metrics", "loss"]) == 0
    assert Image.open(out).size == (640, 360)
    pixels = np.asarray(Image.open(out).convert("RGB"))
    assert _near(pixels, BLUE) > 150 and _near(pixels, ORANGE) == 0  # one run: one line


@pytest.mark.parametrize(("make", "args", "message"), [
    (None, ["--out", "{tmp}/x.png"], "{tmp}/missing: not a run directory (give run.output_dir of a training run)"),
    ("dir", ["--out", "{tmp}/x.png"], "{tmp}/missing/metrics.jsonl: not found (runs write it unless logging.jsonl "
                                      "is false)"),
    ("empty", ["--out", "{tmp}/x.png"], "{tmp}/missing/metrics.jsonl: no steps recorded"),
])
def test_a_bad_run_directory_is_one_line(make, args, message, tmp_path, capsys):
    run = tmp_path / "missing"
    if make:
        run.mkdir()
    if make == "empty":
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": null}\n{"step": 2, "lo')  # a null and a torn line
    assert main(["plot", str(run), *(a.format(tmp=tmp_path) for a in args)]) == 2
    assert capsys.readouterr().err == f"error: {message.format(tmp=tmp_path)}\n"
    assert not (tmp_path / "x.png").exists()


def test_unknown_metric_and_missing_matplotlib_are_one_line(two_runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "x.png"
    assert main(["plot", str(two_runs[0]), "--out", str(out), "--metrics", "loss,perplexity"]) == 2
    assert capsys.readouterr().err == ("error: --metrics: no run recorded perplexity; recorded: grad_norm, loss, lr, "
                                       "mfu, samples_per_s, step_time, tflops, tokens_per_s\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["plot", str(two_runs[0]), "--out", str(out)]) == 2
    assert capsys.readouterr().err == "error: loongforge plot needs matplotlib: pip install 'loongforge-core[plot]'\n"
    assert not out.exists()


def _write_run(directory, rows, interval=None):
    import json

    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if interval is not None:
        step = directory / "checkpoints" / "step-0000006"
        step.mkdir(parents=True)
        (step / "config.yaml").write_text(f"logging:\n  interval: {interval}\n")
    return directory


def test_per_step_values_are_interval_means_and_validation_shares_the_loss_axes(tmp_path, capsys):
    """Means over the run's logging interval (as the step lines print them), val_loss dashed on the loss subplot, a
    run without validation named on the console."""
    from loongforge.plot import interval_means, logging_interval, read_curves
    from PIL import Image

    rows = [{"step": s, "loss": float(10 - s), "lr": 0.1 * s} for s in range(1, 7)]
    rows[2]["val_loss"], rows[5]["val_loss"] = 7.5, 4.5
    with_val = _write_run(tmp_path / "a", rows, interval=3)
    without = _write_run(tmp_path / "b", [{"step": s, "loss": 9.0 - s, "lr": 0.1} for s in range(1, 7)])
    assert logging_interval(with_val) == 3 and logging_interval(without) == 1
    means = interval_means(read_curves(with_val), 3)
    assert means["loss"] == {3: 8.0, 6: 5.0} and means["lr"] == pytest.approx({3: 0.2, 6: 0.5})
    assert means["val_loss"] == {3: 7.5, 6: 4.5}  # evaluations are drawn as recorded
    assert interval_means(read_curves(with_val), 4)["loss"] == {4: 7.5, 6: 4.5}  # a short last window
    out = tmp_path / "curves.png"
    assert main(["plot", str(with_val), str(without), "--out", str(out), "--metrics", "loss,val_loss,lr"]) == 0
    assert capsys.readouterr().out == f"b: recorded no val_loss\nwrote {out}: loss+val_loss, lr of 2 run(s)\n"
    assert Image.open(out).size == (2 * 640, 360)  # two subplots: val_loss has none of its own
    assert main(["plot", str(with_val), "--out", str(out), "--every", "0"]) == 2
    assert capsys.readouterr().err == "error: --every must be >= 1, got 0\n"
