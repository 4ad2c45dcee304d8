"""Resume semantics are explicit (issue 17, item 5): a run resumed with other optimizer or schedule settings than its
checkpoint's is refused in one line listing each key with both values, unless ``checkpoint.override_schedule: true``;
then the schedule is the new config's, continued at the resumed step, and the checkpoint records what really ran."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from loongforge.cli import main

QUICKSTART = "configs/quickstart.yaml"
TINY_LLM = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
            "training.threads=1", "logging.progress=false", "logging.tensorboard=false", "logging.interval=1"]
#: The issue's first run: 10 steps with the recipe's warmup and cosine decay.
FIRST = ["training.steps=10", "checkpoint.interval=5", "scheduler.warmup_steps=4"]
#: ... and its resume with a longer run, a new peak rate and no warmup.
CHANGED = ["training.steps=20", "optimizer.lr=1e-5", "optimizer.min_lr=1e-6", "scheduler.warmup_steps=0"]


def _rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _cosine_lr(step: int, *, peak: float, floor: float, decay_steps: int) -> float:
    """The learning rate megatron's cosine schedule gives before update ``step`` (1-based) with no warmup."""
    done = step - 1
    return floor + (peak - floor) * 0.5 * (math.cos(math.pi * min(done, decay_steps) / decay_steps) + 1.0)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", QUICKSTART, *TINY_LLM, *FIRST, f"run.output_dir={out}"]) == 0
    return out


def test_a_changed_schedule_is_refused_in_one_line_listing_each_key(first_run, tmp_path, capsys):
    out = tmp_path / "run"
    resume = f"checkpoint.resume={first_run / 'checkpoints' / 'step-0000010'}"
    code = main(["train", QUICKSTART, *TINY_LLM, *FIRST, *CHANGED, resume, f"run.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()

    assert code == 2
    assert len(err) == 1, err
    line = err[0]
    assert "optimizer.lr 0.002 -> 1e-05" in line
    assert "scheduler.warmup_steps 4 -> 0" in line
    assert "scheduler.decay_steps 10 -> 20 (from training.steps)" in line
    assert "optimizer.min_lr 0.0002 -> 1e-06" in line
    assert "optimizer.beta1" not in line and "weight_decay" not in line  # unchanged keys are not listed
    assert "checkpoint.override_schedule=true" in line
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


def test_an_unchanged_resume_is_accepted_without_a_word(first_run, tmp_path, capsys):
    out = tmp_path / "run"
    resume = f"checkpoint.resume={first_run / 'checkpoints' / 'step-0000005'}"
    assert main(["train", QUICKSTART, *TINY_LLM, *FIRST, resume, f"run.output_dir={out}"]) == 0
    assert "settings differ" not in capsys.readouterr().err
    # The resumed steps 6..10 reproduce the first run exactly (learning rate and loss).
    resumed, original = _rows(out), _rows(first_run)
    assert [resumed[s]["loss"] for s in range(6, 11)] == [original[s]["loss"] for s in range(6, 11)]
    assert [resumed[s]["lr"] for s in range(6, 11)] == [original[s]["lr"] for s in range(6, 11)]


def test_override_schedule_continues_the_new_schedule_at_the_resumed_step(first_run, tmp_path, capsys):
    out = tmp_path / "run"
    resume = f"checkpoint.resume={first_run / 'checkpoints' / 'step-0000010'}"
    code = main(["train", QUICKSTART, *TINY_LLM, *FIRST, *CHANGED, "checkpoint.override_schedule=true", resume,
                 f"run.output_dir={out}"])
    assert code == 0, capsys.readouterr().err
    assert "continuing with this config's" in capsys.readouterr().err
    rows = _rows(out)
    assert sorted(rows) == list(range(11, 21))
    for step in range(11, 21):  # the new cosine from 1e-5 over 20 steps, 10 of which are done: no warmup replay
        expected = _cosine_lr(step, peak=1e-5, floor=1e-6, decay_steps=20)
        assert rows[step]["lr"] == pytest.approx(expected, rel=1e-9), step
    trainer = json.loads((out / "checkpoints" / "step-0000020" / "trainer.json").read_text())
    assert trainer["scheduler"]["max_lr"] == 1e-5 and trainer["scheduler"]["lr_warmup_steps"] == 0
    assert trainer["schedule_settings"]["optimizer.lr"] == 1e-5
    assert trainer["schedule_settings"]["scheduler.decay_steps"] == 20


@pytest.mark.needs_plugins
def test_a_task_model_resume_is_checked_the_same_way(tmp_path, capsys):
    recipe = "configs/diffusion-squares-image.yaml"
    tiny = ["training.steps=2", "scheduler.warmup_steps=1", "checkpoint.interval=2", "logging.progress=false",
            "logging.tensorboard=false"]
    first = tmp_path / "first"
    assert main(["train", recipe, *tiny, f"run.output_dir={first}"]) == 0
    capsys.readouterr()
    resume = f"checkpoint.resume={first / 'checkpoints' / 'step-0000002'}"
    code = main(["train", recipe, *tiny, "training.steps=4", "optimizer.beta2=0.9", resume,
                 f"run.output_dir={tmp_path / 'second'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "optimizer.beta2" in err[0] and "scheduler.decay_steps" in err[0]

    code = main(["train", recipe, *tiny, "training.steps=4", "optimizer.beta2=0.9", resume,
                 "checkpoint.override_schedule=true", f"run.output_dir={tmp_path / 'third'}"])
    assert code == 0, capsys.readouterr().err
    trainer = json.loads((tmp_path / "third" / "checkpoints" / "step-0000004" / "trainer.json").read_text())
    assert trainer["schedule_settings"]["optimizer.beta2"] == 0.9


def test_which_changes_count_as_schedule_changes():
    from loongforge import load_config
    from loongforge.errors import ConfigError
    from loongforge.train.resume_settings import check_resume_settings, schedule_settings

    def settings(*overrides):
        return load_config(QUICKSTART, ["scheduler.warmup_steps=2", *overrides])

    saved = schedule_settings(settings("training.steps=10"), 8)
    # Extending a cosine run whose decay followed training.steps changes its curve; a constant one does not.
    with pytest.raises(ConfigError, match=r"scheduler\.decay_steps 20 -> 30 \(from training\.steps\)"):
        check_resume_settings(schedule_settings(settings("training.steps=20"), 8), settings("training.steps=30"), 8,
                              "ckpt")
    constant = schedule_settings(settings("training.steps=10", "scheduler.decay=constant"), 8)
    assert not check_resume_settings(constant, settings("training.steps=99", "scheduler.decay=constant"), 8, "ckpt")
    # A pinned decay length may be extended past; the global batch size may not change.
    pinned = schedule_settings(settings("training.steps=10", "scheduler.decay_steps=50"), 8)
    assert not check_resume_settings(pinned, settings("training.steps=40", "scheduler.decay_steps=50"), 8, "ckpt")
    with pytest.raises(ConfigError, match=r"training\.global_batch_size 8 -> 16"):
        check_resume_settings(saved, settings("training.steps=10"), 16, "ckpt")
    # With the override the difference is accepted and reported as a rebuild; checkpoints before 0.2 are not compared.
    assert check_resume_settings(saved, settings("training.steps=30", "checkpoint.override_schedule=true"), 8, "c")
    assert not check_resume_settings(None, settings("optimizer.lr=1"), 8, "ckpt")
