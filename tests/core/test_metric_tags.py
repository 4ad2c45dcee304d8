"""The same ``train/*`` tags for every engine, and interval means: a tiny LLM (megatron engine), diffusion DiT and
robot policy (task engine) from their shipped recipes, 8 steps logged every 4, read back from TensorBoard's event
files and compared with each run's metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from loongforge import load_config
from test_training_loop import RECIPES, ROOT

STEPS, EVERY = 8, 4
#: The tags every engine logs; a model that reads tokens (the LLM) adds train/tokens_per_s and, counting its FLOPs,
#: train/tflops and train/mfu.
COMMON = {"train/loss", "train/lr", "train/grad_norm", "train/step_time", "train/samples_per_s"}
#: Per-step flags and notes of a JSONL row, never tags.
PER_STEP = {"step", "skipped", "bad", "action", "checkpoint"}

pytestmark = pytest.mark.needs_plugins  # two of the three recipes are the plugins' models


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{recipe: (TensorBoard scalars {tag: {step: value}}, JSONL rows)}`` of one tiny run per engine."""
    from loongforge.train.run import run_training
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for recipe, (path, extra) in RECIPES.items():
        out = tmp_path_factory.mktemp(recipe)
        run_training(load_config(str(ROOT / path), [
            f"run.output_dir={out}", *extra, f"training.steps={STEPS}", f"logging.interval={EVERY}",
            "logging.progress=false", "logging.trackers=[tensorboard]", "training.threads=1",
            "training.micro_batch_size=2", "checkpoint.interval=0", "checkpoint.save_at_end=false"]), device="cpu")
        events = EventAccumulator(str(out / "tensorboard"))
        events.Reload()
        scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
        found[recipe] = scalars, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return found


def test_every_engine_logs_the_same_train_tags(runs):
    tags = {recipe: set(scalars) for recipe, (scalars, _) in runs.items()}
    assert tags["diffusion"] == tags["embodied"] == COMMON
    assert tags["llm"] == COMMON | {"train/tokens_per_s", "train/tflops", "train/mfu"}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_tensorboard_holds_every_number_of_the_jsonl_as_interval_means(runs, recipe):
    scalars, rows = runs[recipe]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    numbers = {key for row in rows for key, value in row.items()
               if key not in PER_STEP and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert set(scalars) == {f"train/{key}" for key in numbers}
    for key in numbers:
        logged = scalars[f"train/{key}"]
        assert set(logged) == {EVERY, STEPS}, key
        for end in (EVERY, STEPS):
            interval = [row[key] for row in rows if end - EVERY < row["step"] <= end]
            # the learning rate shown is the logging step's own; every other number the interval's mean
            expected = interval[-1] if key == "lr" else sum(interval) / len(interval)
            assert logged[end] == pytest.approx(expected, rel=1e-6), (key, end)
    losses = [row["loss"] for row in rows[:EVERY]]
    assert len(set(losses)) > 1  # a mean of different values: the check above can tell a mean from the last value
