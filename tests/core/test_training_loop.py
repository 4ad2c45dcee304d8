"""One training loop over both step engines: an LLM (megatron engine), a diffusion DiT and a robot policy (task
engine) trained from their shipped recipes, made tiny, behave the same where the loop is concerned -- TensorBoard
tags and interval averages, refusing ``logging.interval=0``, ``should_stop``, the learning rate of the same
``scheduler:`` section, the trainer type hooks receive and one ``backend.apply_patches()`` per run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config
from loongforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: The same loop settings and schedule for every recipe: 1 warmup step, cosine decay to step 5, a logging interval
#: of 2 (so steps 1-2 are averaged) and a plugin stopping the run at step 3 of 5 (between two logging steps).
COMMON = ["logging.progress=false", "logging.tensorboard=true", "logging.interval=2", "training.threads=1",
          "training.steps=5", "checkpoint.save_at_end=false", "checkpoint.interval=0", "optimizer.lr=1e-3",
          "optimizer.min_lr=1e-4", "scheduler.warmup_steps=1", "scheduler.decay=cosine", "scheduler.decay_steps=5",
          "training.micro_batch_size=2"]
RECIPES = {
    "llm": ("configs/quickstart.yaml", ["model.overrides.num_layers=1", "data.seq_length=32",
                                        "training.sample_tokens=0"]),
    "diffusion": ("configs/diffusion-moving-squares.yaml", ["model.overrides.num_layers=1", "task.samples=16",
                                                             "task.sample={videos: 0}"]),
    "embodied": ("configs/embodied-tiny.yaml", ["model.overrides={text_len: 24, depth: 1, vision_depth: 0}",
                                                "task.synthetic={episodes: 3, length: 8}", "task.held_out_episodes=1",
                                                "task.action_horizon=4", "task.eval={frames: 0}"]),
}
STOP_AT = 3
#: The TensorBoard scalars every engine writes; a model that reads tokens (the LLM) adds ``train/tokens_per_s``,
#: ``train/tflops`` and ``train/mfu``.
TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/step_time", "train/samples_per_s"}


def _expected_lr(step: int) -> float:
    """megatron-core's warmup + cosine schedule in closed form: step s trains at the rate of s-1 steps taken."""
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 1, 5
    taken = step - 1
    if taken <= warmup:
        return lr * taken / warmup
    return min_lr + 0.5 * (math.cos(math.pi * (taken - warmup) / (decay - warmup)) + 1.0) * (lr - min_lr)


class StopAndLook:
    """Sets ``should_stop`` after step ``STOP_AT`` and records the trainer each hook receives."""

    def __init__(self) -> None:
        self.trainers: list[object] = []
        self.steps: list[int] = []

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.trainers.append(trainer)

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        self.trainers.append(trainer)
        self.steps.append(step)
        trainer.should_stop = step >= STOP_AT


@pytest.mark.parametrize("recipe", [name if name == "llm" else pytest.param(name, marks=pytest.mark.needs_plugins)
                                    for name in sorted(RECIPES)])  # the task recipes are the plugins' models
def test_both_engines_behave_the_same_under_the_loop(recipe, tmp_path, register_plugin, monkeypatch):
    from loongforge.devices.cpu import CPUBackend
    from loongforge.train.run import run_training
    from loongforge.train.trainer import Trainer
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, extra = RECIPES[recipe]
    out = tmp_path / "run"

    def config(*overrides: str):
        return load_config(str(ROOT / path), [f"run.output_dir={out}", *COMMON, *extra, *overrides])

    patches: list[CPUBackend] = []
    original = CPUBackend.apply_patches

    def counted(self: CPUBackend) -> None:
        patches.append(self)
        original(self)

    monkeypatch.setattr(CPUBackend, "apply_patches", counted)

    with pytest.raises(ConfigError) as refused:
        run_training(config("logging.interval=0"), device="cpu")
    assert str(refused.value) == f"{ROOT / path}: logging.interval must be an integer >= 1, got 0"
    assert patches == []  # refused before anything was set up

    plugin = register_plugin(StopAndLook(), "stop-and-look")
    summary = run_training(config(), device="cpu")
    assert len(patches) == 1
    engine = {"llm": "megatron"}.get(recipe, "task")
    assert {type(t) for t in plugin.trainers} == {Trainer} and plugin.trainers[0].engine.name == engine

    assert plugin.steps == [1, 2, 3] and summary["steps"] == STOP_AT
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["lr"] for row in rows] == [_expected_lr(s) for s in (1, 2, 3)]
    assert [row["lr"] for row in rows] == pytest.approx([0.0, 1e-3, 8.681980515339464e-4], rel=1e-12)

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    # the LLM counts tokens and model FLOPs (so TFLOP/s and MFU); the task models count samples only
    llm_tags = {"train/tokens_per_s", "train/tflops", "train/mfu"}
    assert set(events.Tags()["scalars"]) == TAGS | (llm_tags if recipe == "llm" else set())
    loss = {event.step: event.value for event in events.Scalars("train/loss")}
    # step 2 logs the mean of steps 1-2; step 3 (stopped between logging steps) logs itself
    assert set(loss) == {2, 3}
    assert loss[2] == pytest.approx((rows[0]["loss"] + rows[1]["loss"]) / 2, rel=1e-6)
    assert loss[3] == pytest.approx(rows[2]["loss"], rel=1e-6)
    times = {event.step: event.value for event in events.Scalars("train/step_time")}
    assert times[2] == pytest.approx((rows[0]["step_time"] + rows[1]["step_time"]) / 2, rel=1e-6)


@pytest.mark.parametrize(("override", "message"), [
    ("training.steps=0", "training.steps must be an integer >= 1, got 0"),
    ("logging.interval=-3", "logging.interval must be an integer >= 1, got -3"),
    ("checkpoint.interval=-1", "checkpoint.interval must be an integer >= 0 (0 saves only at the end), got -1"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last must be an integer >= 0 (0 keeps every checkpoint), got -1"),
])
def test_loop_settings_are_refused_in_one_line(override, message):
    from loongforge.train.loop import validate_loop_settings

    source = load_config(None).source
    with pytest.raises(ConfigError) as refused:
        validate_loop_settings(load_config(None, [override]))
    assert str(refused.value) == f"{source}: {message}"
