"""Numerical health and metrics that survive a crash (issue 17): a diverging run stops at its first NaN/Inf step
with one line and exit status 2, keeps only the healthy checkpoints saved before it, and writes metrics.jsonl as
valid JSON (``null`` for NaN); the metrics of a saved step are on disk when its checkpoint is, and a resumed run
appends after it without holes or duplicates."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config
from loongforge.cli import main
from loongforge.errors import TrainingDivergedError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
TINY_LLM = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
            "training.threads=1", "logging.progress=false", "logging.tensorboard=false"]
#: The issue's reproduction: a learning rate of 1e3 blows the loss up within a few steps and ends in NaN.
DIVERGING = ["optimizer.lr=1e3", "optimizer.min_lr=0", "training.steps=20", "checkpoint.interval=5",
             "checkpoint.keep_last=2"]


def _rows(out: Path) -> list[dict]:
    """metrics.jsonl, each line parsed as strict JSON (a bare NaN or Infinity fails)."""
    def strict(name: str) -> None:
        raise ValueError(f"metrics.jsonl holds the non-JSON number {name}")

    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line, parse_constant=strict) for line in lines]


def _saved_steps(out: Path) -> list[int]:
    names = (re.fullmatch(r"step-(\d+)", p.name) for p in (out / "checkpoints").iterdir())
    return sorted(int(m.group(1)) for m in names if m)


def _healthy(row: dict) -> bool:
    """Loss and gradient norm were finite (both recipes clip gradients, so a ``null`` is a NaN or infinity)."""
    return row["loss"] is not None and row["grad_norm"] is not None


def test_a_diverging_llm_stops_at_its_first_nonfinite_step(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", QUICKSTART, *TINY_LLM, *DIVERGING, f"run.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()

    rows = _rows(out)
    bad = next(row for row in rows if not _healthy(row))
    # The run really diverged (no value was injected) and stopped at the first bad step, whose metrics are kept.
    assert max(row["loss"] for row in rows[:bad["step"] - 1]) > 1e3
    assert [row["step"] for row in rows] == list(range(1, bad["step"] + 1))
    key = "loss" if bad["loss"] is None else "grad_norm"
    assert code == 2
    assert len(err) == 1 and "Traceback" not in err[0], err
    saved = _saved_steps(out)
    assert saved and max(saved) < bad["step"] and saved == [s for s in (5, 10, 15) if s < bad["step"]][-2:]
    newest = out / "checkpoints" / f"step-{max(saved):07d}"
    assert re.fullmatch(rf"error: step {bad['step']}: {key} is (nan|inf|-inf) \(training\.on_nonfinite: stop\); "
                        rf"the newest checkpoint before it is {re.escape(str(newest))}", err[0]), err[0]


class Poison:
    """Wraps an engine's ``train_step`` so that step ``at`` reports ``field`` as ``value``."""

    def __init__(self, at: int, field: str, value: float) -> None:
        self.at, self.field, self.value, self.calls = at, field, value, 0

    def wrap(self, train_step):
        def poisoned(engine):
            result = train_step(engine)
            self.calls += 1
            return dataclasses.replace(result, **{self.field: self.value}) if self.calls == self.at else result
        return poisoned


@pytest.mark.needs_plugins  # the task recipe's model is a plugin's
@pytest.mark.parametrize(("field", "value", "shown"), [("grad_norm", float("inf"), "inf"),
                                                        ("loss", float("nan"), "nan")])
def test_the_task_engine_follows_the_same_rule(tmp_path, monkeypatch, field, value, shown):
    from loongforge.train.engines.task import TaskEngine
    from loongforge.train.run import run_training

    out = tmp_path / "run"
    config = load_config(str(ROOT / "configs/diffusion-moving-squares.yaml"), [
        f"run.output_dir={out}", "model.overrides.num_layers=1", "task.samples=16", "task.sample={videos: 0}",
        "training.micro_batch_size=2", "training.threads=1", "logging.progress=false", "logging.tensorboard=false",
        "logging.interval=10", "training.steps=8", "checkpoint.interval=2", "checkpoint.keep_last=0"])
    monkeypatch.setattr(TaskEngine, "train_step", Poison(5, field, value).wrap(TaskEngine.train_step))
    with pytest.raises(TrainingDivergedError) as stopped:
        run_training(config, device="cpu")
    newest = out / "checkpoints" / "step-0000004"
    assert str(stopped.value) == (f"step 5: {field} is {shown} (training.on_nonfinite: stop); "
                                  f"the newest checkpoint before it is {newest}")
    assert _saved_steps(out) == [2, 4]  # neither step 6's interval save nor the end save happened
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5] and rows[-1][field] is None
    assert all(_healthy(row) for row in rows[:-1])


class Crash:
    """At ``on_step_end`` of step ``at`` -- right after the checkpoint of step ``at - 1`` -- records what
    metrics.jsonl holds on disk (what a SIGKILL at that moment would leave) and stops the run."""

    def __init__(self, out: Path, at: int) -> None:
        self.out, self.at, self.on_disk = out, at, None

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        if step == self.at:
            self.on_disk = _rows(self.out)
            trainer.should_stop = True


def test_metrics_of_a_saved_step_are_on_disk_and_resume_appends_after_it(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    out = tmp_path / "run"

    def config(*overrides: str):
        return load_config(str(ROOT / QUICKSTART), [f"run.output_dir={out}", *TINY_LLM, "logging.interval=10",
                                                    "checkpoint.interval=3", "checkpoint.save_at_end=false",
                                                    "training.sample_tokens=0", *overrides])

    crash = register_plugin(Crash(out, at=4), "crash")
    run_training(config("training.steps=6"), device="cpu")
    # Step 3 is no logging step, yet its checkpoint's metrics are on disk (step 4's line is still buffered).
    assert [row["step"] for row in crash.on_disk] == [1, 2, 3]
    assert _saved_steps(out) == [3]
    first = _rows(out)
    assert [row["step"] for row in first] == [1, 2, 3, 4]  # closed cleanly: step 4 reached the file too

    crash.at = None
    run_training(config("training.steps=6"), device="cpu")  # resumes from step 3: step 4's line is replaced
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:3] == first[:3]
    assert rows[3]["loss"] == first[3]["loss"]  # the resumed step 4 repeats the lost one bit for bit
