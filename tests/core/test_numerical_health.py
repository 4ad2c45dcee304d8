"""Numerical health and metrics that survive a crash (issue 17): a diverging run stops at its first NaN/Inf step
with one line and exit status 2, keeps only the healthy checkpoints saved before it, and writes metrics.jsonl as
valid JSON (``null`` for NaN); the metrics of a saved step are on disk when its checkpoint is, and a resumed run
appends after it without holes or duplicates.

The recovering policies run through the CLI with a plugin that corrupts chosen forwards of the real model
(:class:`Fault`): ``skip_step`` leaves the bad update out in both engines (weights, Adam's moments and step count,
the schedule and a task's EMA are what they were before the step), ``rewind`` goes back to the newest checkpoint and
on with the batches after the bad one, ``max_recoveries`` bounds both, and a loss spike is a bad step too."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from loongforge import hookimpl, load_config
from loongforge.cli import main
from loongforge.errors import TrainingDivergedError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
TINY_LLM = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
            "training.threads=1", "logging.progress=false", "logging.tensorboard=false"]
#: The issue's reproduction: a learning rate of 1e3 blows the loss up within a few steps (a spike), the model then
#: collapses (gradient norm exactly 0, the loss flat) and ends in NaN.
DIVERGING = ["optimizer.lr=1e3", "optimizer.min_lr=0", "training.steps=20", "checkpoint.interval=5",
             "checkpoint.keep_last=2"]
#: Spike and collapse detection off: what reaches the first non-finite step.
FINITENESS_ONLY = ["training.spike_factor=null", "training.collapse_steps=null"]


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
    code = main(["train", QUICKSTART, *TINY_LLM, *DIVERGING, *FINITENESS_ONLY, f"run.output_dir={out}"])
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
                        rf"the newest healthy checkpoint before it is {re.escape(str(newest))}", err[0]), err[0]


def test_by_default_the_diverging_run_stops_at_its_spike(tmp_path, capsys):
    """The default spike detection ends the issue's run at the step whose loss leaps from ~6 to ~1e6, before the
    model collapses and before any checkpoint of it exists."""
    out = tmp_path / "run"
    code = main(["train", QUICKSTART, *TINY_LLM, *DIVERGING, f"run.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    rows = _rows(out)
    assert code == 2 and len(err) == 1 and rows[-1]["bad"] == "spike" and rows[-1]["step"] <= 5
    median = statistics.median(row["loss"] for row in rows[:-1])
    assert rows[-1]["loss"] > 20 * median and median < 10
    assert re.fullmatch(rf"error: step {rows[-1]['step']}: loss spike: .* > 20\.0 x .*; no healthy checkpoint was "
                        r"saved before it", err[0]), err[0]


def test_a_collapsed_model_is_stopped_and_its_checkpoint_never_named(tmp_path, capsys):
    """Without spike detection the issue's run collapses: the loss sits still with a gradient norm of exactly 0.
    Five such steps stop it, and the checkpoint saved during them is not the one the error names."""
    out = tmp_path / "run"
    code = main(["train", QUICKSTART, *TINY_LLM, *DIVERGING, "training.spike_factor=null", f"run.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    rows = _rows(out)
    bad = rows[-1]
    assert code == 2 and len(err) == 1 and bad["bad"] == "collapse"
    flat = [row for row in rows if row["grad_norm"] == 0.0]
    assert len(flat) == 5 and flat[-1] is bad and len({row["loss"] for row in flat}) == 1
    since = flat[0]["step"]
    assert any(s >= since for s in _saved_steps(out))  # a checkpoint of the collapsed model exists ...
    assert err[0] == (f"error: step {bad['step']}: collapse: gradient norm exactly 0 with a learning rate above 0 "
                      f"for 5 steps in a row (since step {since}) (training.on_nonfinite: stop); no healthy "
                      "checkpoint was saved before it")  # ... and is not offered as the one to resume from


class Poison:
    """Wraps an engine's ``train_step`` so that step ``at`` reports ``field`` as ``value``."""

    def __init__(self, at: int, field: str, value: float) -> None:
        self.at, self.field, self.value, self.calls = at, field, value, 0

    def wrap(self, train_step):
        def poisoned(engine, screen=None):
            result = train_step(engine, screen)
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
                                  f"the newest healthy checkpoint before it is {newest}")
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


# -- the recovering policies ------------------------------------------------------------------------------------------

#: A short run of the tiny LLM with no text sample at the end.
SHORT_LLM = [*TINY_LLM, "training.sample_tokens=0", "logging.interval=1"]


class Fault:
    """A plugin that, through ``loongforge_modify_model`` as any plugin may, corrupts chosen forwards of the model.

    ``nan`` multiplies the forward's output by NaN (loss and gradients NaN); ``grad_inf`` keeps the output but
    makes the gradient flowing back through it infinite (a finite loss over non-finite gradients); ``spike``
    multiplies the output by 50 (a finite loss far above the others). Forwards are counted over the run -- one per
    step here -- so a step trained again after a rewind is not corrupted again. ``inputs`` keeps each forward's
    first input (the batch's tokens, showing the data order); ``states`` each step's weights, optimizer state and
    task state at ``on_step_end``; ``loaded`` the same right after a checkpoint was loaded.
    """

    def __init__(self, kind: str, at: set[int]) -> None:
        self.kind = kind
        self.restart(at)

    def restart(self, at: set[int]) -> None:
        """Count afresh, for another run, corrupting the forwards ``at``."""
        self.at = at
        self.forwards = 0
        self.inputs: list[torch.Tensor] = []
        self.states: dict[int, dict] = {}
        self.loaded: dict | None = None

    @hookimpl
    def loongforge_modify_model(self, model):
        (model[0] if isinstance(model, list) else model).register_forward_hook(self._forward)

    def _forward(self, module, args, output):
        self.forwards += 1
        self.inputs.append(args[0].detach().clone())
        if self.forwards not in self.at:
            return None
        if self.kind == "grad_inf":
            output.register_hook(lambda grad: grad * float("inf"))
            return None
        return output * (float("nan") if self.kind == "nan" else 50.0)

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        self.states[step] = _state(trainer)

    @hookimpl
    def loongforge_on_checkpoint_load(self, trainer):
        self.loaded = _state(trainer)


def _state(trainer) -> dict:
    """What an update changes: weights and optimizer state (moments, step counts); and a task's own state."""
    chunks = trainer.model if isinstance(trainer.model, list) else [trainer.model]
    state = {"weights": {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(chunks)
                         for name, p in chunk.named_parameters()},
             "optimizer": copy.deepcopy(trainer.optimizer.state_dict())}
    task = {"task": copy.deepcopy(trainer.engine.task.state_dict())} if trainer.engine.name == "task" else {}
    return {**state, **task}


def _equal(a, b) -> bool:
    """Exactly equal, tensors bit for bit, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _train_cli(capsys, out: Path, *overrides: str) -> tuple[int, list[str]]:
    """``loongforge train`` of the tiny LLM (in this process, as the console script runs it); exit status and the
    stderr lines."""
    code = main(["train", QUICKSTART, *SHORT_LLM, f"run.output_dir={out}", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def _assert_skipped(fault: Fault, rows: list[dict], step: int) -> None:
    """Step ``step`` left the weights and the optimizer as the step before it left them, and training went on."""
    for part in ("weights", "optimizer"):
        assert _equal(fault.states[step][part], fault.states[step - 1][part]), part
    assert not _equal(fault.states[step + 1]["weights"], fault.states[step]["weights"])
    # The schedule stood still for the skipped update (it moves every step during warmup otherwise).
    assert rows[step]["lr"] == rows[step - 1]["lr"] != rows[step - 2]["lr"]


@pytest.mark.parametrize(("kind", "what"), [("nan", "loss is nan"), ("grad_inf", "gradients are not finite (nan)")])
def test_skip_step_leaves_the_bad_update_out_llm(tmp_path, capsys, register_plugin, kind, what):
    out = tmp_path / "run"
    fault = register_plugin(Fault(kind, at={3}), "fault")
    code, err = _train_cli(capsys, out, "training.steps=5", "training.on_nonfinite=skip_step")

    assert code == 0, err
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    bad = rows[2]
    assert (bad["bad"], bad["action"], bad["skipped"]) == ("nonfinite", "skip_step", True)
    assert (bad["loss"] is None) == (kind == "nan")  # grad_inf: the loss itself was finite
    assert [row for row in rows if "bad" in row] == [bad]
    _assert_skipped(fault, rows, 3)
    assert all(torch.isfinite(w).all() for w in fault.states[5]["weights"].values())
    assert _saved_steps(out) == [5]
    assert [line for line in err if "warning" in line] == [
        f"[loongforge] warning: step 3: {what}; its update was left out (recovery 1 of training.max_recoveries 3) "
        "(training.on_nonfinite: skip_step)"]


@pytest.mark.needs_plugins  # the task recipe's model is a plugin's
def test_skip_step_leaves_the_bad_update_out_task(tmp_path, capsys, register_plugin):
    out = tmp_path / "run"
    fault = register_plugin(Fault("nan", at={3}), "fault")
    code = main(["train", "configs/diffusion-moving-squares.yaml", f"run.output_dir={out}",
                 "model.overrides.num_layers=1", "task.samples=16", "task.sample={videos: 0}",
                 "training.micro_batch_size=2", "training.threads=1", "logging.progress=false",
                 "logging.tensorboard=false", "logging.interval=1", "training.steps=5", "checkpoint.interval=0",
                 "training.on_nonfinite=skip_step"])
    err = capsys.readouterr().err

    assert code == 0, err
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert (rows[2]["bad"], rows[2]["action"], rows[2]["loss"]) == ("nonfinite", "skip_step", None)
    _assert_skipped(fault, rows, 3)
    # The task's after-step work did not run either: its EMA of the weights is as after step 2. (Its noise draws
    # moved on with the data: ``steps`` counts the batches drawn.)
    before, after = fault.states[2]["task"]["ema"], fault.states[3]["task"]["ema"]
    assert after["num_updates"] == before["num_updates"] == 2 and _equal(after["shadow"], before["shadow"])
    assert fault.states[4]["task"]["ema"]["num_updates"] == 3
    assert "step 3: loss is nan; its update was left out" in err


def test_rewind_reloads_the_newest_checkpoint_and_goes_on_after_the_bad_batch(tmp_path, capsys, register_plugin):
    fault = register_plugin(Fault("nan", at=set()), "fault")
    assert _train_cli(capsys, tmp_path / "straight", "training.steps=10", "checkpoint.interval=0")[0] == 0
    uninterrupted = fault.inputs

    out = tmp_path / "run"
    fault.restart(at={5})
    code, err = _train_cli(capsys, out, "training.steps=8", "checkpoint.interval=3", "checkpoint.keep_last=0",
                           "training.on_nonfinite=rewind")

    assert code == 0, err
    rows = _rows(out)
    newest = out / "checkpoints" / "step-0000003"
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]  # steps 4 and 5 trained again
    bad = rows[4]
    assert (bad["bad"], bad["action"], bad["checkpoint"]) == ("nonfinite", "rewind", str(newest))
    assert [row for row in rows if "bad" in row] == [bad]
    # Training went on from the checkpoint's weights, optimizer state and schedule ...
    assert _equal(fault.loaded, fault.states[3])
    assert rows[5]["lr"] == rows[3]["lr"]
    # ... but not with the same batches: the data went on after the bad batch, as in the run without a fault.
    assert len(fault.inputs) == 10
    assert all(torch.equal(a, b) for a, b in zip(fault.inputs, uninterrupted, strict=True))
    assert _saved_steps(out) == [3, 6, 8]
    assert f"[loongforge] warning: step 5: loss is nan; rewound to {newest} (step 3), going on with the batches " \
           "after this one (recovery 1 of training.max_recoveries 3) (training.on_nonfinite: rewind)" in err, err


def test_rewind_without_a_checkpoint_stops(tmp_path, capsys, register_plugin):
    register_plugin(Fault("nan", at={2}), "fault")
    code, err = _train_cli(capsys, tmp_path / "run", "training.steps=4", "checkpoint.interval=0",
                           "training.on_nonfinite=rewind")
    assert code == 2
    assert err == ["error: step 2: loss is nan (training.on_nonfinite: rewind; no checkpoint to rewind to yet); no "
                   "healthy checkpoint was saved before it"]
    rows = _rows(tmp_path / "run")
    assert [(row["step"], row.get("action")) for row in rows] == [(1, None), (2, "stop")]


def test_recoveries_beyond_max_recoveries_stop(tmp_path, capsys, register_plugin):
    out = tmp_path / "run"
    register_plugin(Fault("nan", at={2, 4}), "fault")
    code, err = _train_cli(capsys, out, "training.steps=6", "checkpoint.interval=3",
                           "training.on_nonfinite=skip_step", "training.max_recoveries=1")
    assert code == 2
    assert err[-1] == (f"error: step 4: loss is nan (training.on_nonfinite: skip_step; bad step 2, over "
                       "training.max_recoveries 1); the newest healthy checkpoint before it is "
                       f"{out}/checkpoints/step-0000003")
    assert [(row["step"], row.get("action")) for row in _rows(out)] == [
        (1, None), (2, "skip_step"), (3, None), (4, "stop")]
    assert _saved_steps(out) == [3]


#: Spike detection over a short window: the tiny LLM's loss never triples from one step to the next on its own.
SPIKES = ["training.spike_factor=3", "training.spike_window=3"]


@pytest.mark.parametrize("policy", ["stop", "skip_step"])
def test_a_loss_spike_is_a_bad_step(tmp_path, capsys, register_plugin, policy):
    out = tmp_path / "run"
    fault = register_plugin(Fault("spike", at={5}), "fault")
    code, err = _train_cli(capsys, out, "training.steps=6", *SPIKES, f"training.on_nonfinite={policy}")

    rows = _rows(out)
    spike, median = rows[4]["loss"], statistics.median(row["loss"] for row in rows[1:4])
    assert spike > 3 * median  # a real forward, 50 times louder: finite, and above the factor
    assert (rows[4]["bad"], rows[4]["action"]) == ("spike", policy)
    what = f"loss spike: {spike!r} > 3.0 x {median!r} (the median loss of the previous 3 steps)"
    if policy == "stop":
        assert code == 2 and [row["step"] for row in rows] == [1, 2, 3, 4, 5]
        assert err == [f"error: step 5: {what} (training.on_nonfinite: stop); "
                       "no healthy checkpoint was saved before it"]
    else:
        assert code == 0 and [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
        assert "bad" not in rows[5]  # the spike's loss stayed out of the window
        assert _equal(fault.states[5]["weights"], fault.states[4]["weights"])
        assert f"[loongforge] warning: step 5: {what}; its update was left out (recovery 1 of " \
               "training.max_recoveries 3) (training.on_nonfinite: skip_step)" in err


class Flatline:
    """Wraps an engine's ``train_step`` so that the calls in ``at`` report a gradient norm of exactly 0."""

    def __init__(self, at: set[int]) -> None:
        self.at, self.calls = at, 0

    def wrap(self, train_step):
        def flat(engine, screen=None):
            result = train_step(engine, screen)
            self.calls += 1
            return dataclasses.replace(result, grad_norm=0.0) if self.calls in self.at else result
        return flat


def test_rewind_after_a_collapse_goes_to_the_newest_healthy_checkpoint(tmp_path, capsys, monkeypatch):
    """Steps 7-11 report a zero gradient norm: the checkpoint of step 8 was saved during that streak, so the
    collapse at step 11 rewinds past it to step 4's."""
    from loongforge.train.engines.megatron import MegatronEngine

    monkeypatch.setattr(MegatronEngine, "train_step", Flatline(set(range(7, 12))).wrap(MegatronEngine.train_step))
    out = tmp_path / "run"
    code, err = _train_cli(capsys, out, "training.steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                           "training.on_nonfinite=rewind")
    assert code == 0, err
    rows = _rows(out)
    healthy = out / "checkpoints" / "step-0000004"
    assert [row["step"] for row in rows] == [*range(1, 12), *range(5, 13)]
    bad = rows[10]
    assert (bad["step"], bad["bad"], bad["action"], bad["checkpoint"]) == (11, "collapse", "rewind", str(healthy))
    assert 8 in _saved_steps(out)
    assert (f"[loongforge] warning: step 11: collapse: gradient norm exactly 0 with a learning rate above 0 for 5 "
            f"steps in a row (since step 7); rewound to {healthy} (step 4)") in "\n".join(err), err


def test_flat_losses_collapse_only_while_learning_and_near_zero_losses_do_not_spike():
    from loongforge.config.schema import TrainingConfig
    from loongforge.train.health import COLLAPSE, StepHealth

    health = StepHealth(TrainingConfig())
    verdicts = [health.judge(2.5, 1.0, lr=1e-3, step=s) for s in range(1, 7)]  # the first sets the level
    assert verdicts[:5] == [None] * 5 and verdicts[5].kind == COLLAPSE and verdicts[5].since == 2
    warmup = StepHealth(TrainingConfig())
    assert all(warmup.judge(2.5, 1.0, lr=0.0, step=s) is None for s in range(1, 10))  # nothing moves at lr 0
    moving = StepHealth(TrainingConfig())
    assert all(moving.judge(1e-4 * (1 - 1e-3 * s), 1e-3, lr=1e-3, step=s) is None for s in range(1, 20))
    memorised = StepHealth(TrainingConfig())
    for loss in [0.01, 0.012, 0.011, 0.009]:
        memorised.accept(loss)
    assert memorised.judge(0.5, 1.0, lr=1e-3, step=5) is None  # 50 times the median, but 0.49 above it


def test_spike_detection_leaves_a_healthy_run_alone(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _train_cli(capsys, out, "training.steps=12", *SPIKES, "training.on_nonfinite=skip_step")
    assert code == 0, err
    rows = _rows(out)
    assert len(rows) == 12 and not any("bad" in row or row["skipped"] for row in rows)
    assert not any("warning" in line for line in err), err


@pytest.mark.parametrize(("override", "message"), [
    ("training.spike_factor=1", "training.spike_factor must be a number > 1 (or null: no spike detection), got 1.0"),
    ("training.spike_factor=.nan", "training.spike_factor must be a number > 1 (or null: no spike detection), "
                                   "got nan"),
    ("training.spike_window=0", "training.spike_window must be an integer >= 1, got 0"),
    ("training.max_recoveries=-1", "training.max_recoveries must be an integer >= 0, got -1"),
    ("training.collapse_steps=1", "training.collapse_steps must be an integer >= 2 (or null: no collapse "
                                  "detection), got 1"),
    ("training.spike_min_increase=-1", "training.spike_min_increase must be a number >= 0, got -1.0"),
])
def test_health_settings_out_of_range_are_one_line(capsys, override, message):
    assert main(["check", QUICKSTART, override]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {QUICKSTART}: {message}"]
