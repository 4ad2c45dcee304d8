"""Evaluation during training for task-engine models -- the Wan and Qwen-Image DiTs (loongforge-diffusion) and a
Pi0.5 policy (loongforge-embodied) -- trained from their shipped recipes, made tiny.

For each: ``val_loss`` rows and ``val/loss`` TensorBoard scalars appear exactly at the configured steps and the
last; the number equals the task's validation loss of the checkpoint saved at that step, recomputed in this process
from the checkpoint over the same validation samples and seeds (so it is deterministic and uses that step's
weights); and the training losses are bit for bit those of the same run without evaluation (the evaluation draws
from no training stream and moves no data position). A task without held-out data is refused in one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from loongforge import load_config
from loongforge.errors import ConfigError

pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["logging.progress=false", "logging.interval=1", "training.threads=1", "training.steps=4",
          "training.micro_batch_size=2", "scheduler.warmup_steps=1", "checkpoint.save_at_end=false"]
RECIPES = {
    "wan": ("configs/diffusion-moving-squares.yaml", ["model.overrides.num_layers=1", "task.samples=16",
                                                      "task.sample={videos: 0}"]),
    "qwen-image": ("configs/diffusion-squares-image.yaml", ["model.overrides.num_layers=1", "task.samples=16",
                                                            "task.sample={images: 0}"]),
    "pi05": ("configs/embodied-tiny.yaml", ["model.overrides={text_len: 24, depth: 1, vision_depth: 0}",
                                            "task.synthetic={episodes: 3, length: 8}", "task.held_out_episodes=1",
                                            "task.action_horizon=4", "task.eval={frames: 0}"]),
}
TRAIN_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/step_time", "train/samples_per_s"}
EVAL = ["evaluation.interval=3", "evaluation.steps=2"]


def _config(recipe: str, out: Path, *overrides: str):
    path, extra = RECIPES[recipe]
    return load_config(str(ROOT / path), [f"run.output_dir={out}", *COMMON, *extra, *overrides])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _recomputed(checkpoint: Path, samples: int, global_batch: int, paths: list[str] | None = None) -> float:
    """The mean over global batches of the task's validation loss of ``checkpoint``'s model, rebuilt from the
    checkpoint alone, with each sample's generator seeded by (run seed, the evaluation's step 0, index), on the
    validation samples of ``paths`` (default: the task's held-out split)."""
    import torch
    from loongforge.tasks import sample_generators
    from loongforge.train.task_checkpoint import load_task_model

    task, model, path = load_task_model(checkpoint)
    seed = load_config(str(path / "config.yaml")).run.seed
    dataset = task.validation_dataset(paths or [], samples)
    losses = []
    with torch.no_grad():
        for first in range(0, samples, global_batch):
            indices = list(range(first, first + global_batch))
            items = [dataset[i] for i in indices]
            batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
            batch["index"] = torch.tensor(indices)
            losses.append(float(task.validation_loss(model, batch, sample_generators(seed, 0, batch["index"]))))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_task_validation_loss_rows_tensorboard_recomputation_and_no_effect_on_training(recipe, tmp_path):
    from loongforge.train.run import run_training
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    on = tmp_path / "on"
    summary = run_training(_config(recipe, on, *EVAL, "checkpoint.interval=3", "logging.tensorboard=true"),
                           device="cpu")
    rows = _rows(on)
    evaluated = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    assert sorted(evaluated) == [3, 4] and all(math.isfinite(v) for v in evaluated.values())
    assert all(set(row) & {"val_ppl"} == set() for row in rows)  # a task's loss is no token cross-entropy
    assert summary["val_loss"] == evaluated[4]

    events = EventAccumulator(str(on / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == TRAIN_TAGS | {"val/loss"}
    assert {e.step: e.value for e in events.Scalars("val/loss")} == pytest.approx(evaluated, rel=1e-6)

    # micro_batch_size 2 on one process: a global batch of 2, two of them per evaluation
    assert evaluated[3] == pytest.approx(_recomputed(on / "checkpoints" / "step-0000003", 4, 2), rel=1e-6, abs=0)

    off = tmp_path / "off"
    run_training(_config(recipe, off, "checkpoint.interval=3", "logging.tensorboard=false"), device="cpu")
    assert [(r["loss"], r["grad_norm"]) for r in _rows(off)] == [(r["loss"], r["grad_norm"]) for r in rows]


def _write_validation_data(recipe: str, config, where: Path) -> str:
    """Separate validation data in the task's own format: a written moving-squares set (Wan) or a LeRobotDataset
    root of other episodes (policy), from seeds the training data does not use."""
    from loongforge.plugins import get_host
    from loongforge.resolve import resolve_model_flavor

    flavor = resolve_model_flavor(config, get_host())
    if recipe == "wan":
        from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, write

        geometry = Geometry(config.task["frames"], config.task["side"], config.task.get("speed", 2))
        return str(write(where / "valid.pt", MovingSquares(6, text_dim=flavor.text_dim, seed=5, geometry=geometry)))
    from loongforge_embodied.policies.reach import write_reach_dataset

    return str(write_reach_dataset(where / "reach-valid", episodes=1, length=8, image_size=flavor.image_size, seed=3))


@pytest.mark.parametrize("recipe", ["wan", "pi05"])
def test_task_evaluation_reads_evaluation_data_in_the_tasks_format(recipe, tmp_path):
    from loongforge.train.run import run_training

    config = _config(recipe, tmp_path / "run", *EVAL, "checkpoint.interval=3", "logging.tensorboard=false")
    path = _write_validation_data(recipe, config, tmp_path)
    config = _config(recipe, tmp_path / "run", *EVAL, "checkpoint.interval=3", "logging.tensorboard=false",
                     f"evaluation.data=[{path}]")
    run_training(config, device="cpu")
    evaluated = {row["step"]: row["val_loss"] for row in _rows(tmp_path / "run") if "val_loss" in row}
    assert sorted(evaluated) == [3, 4]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000003"
    assert evaluated[3] == pytest.approx(_recomputed(checkpoint, 4, 2, [path]), rel=1e-6, abs=0)
    assert evaluated[3] != pytest.approx(_recomputed(checkpoint, 4, 2), rel=1e-3)  # not the held-out split


@pytest.mark.parametrize(("recipe", "overrides", "message"), [
    ("pi05", ["task.held_out_episodes=0"], "evaluation: task.held_out_episodes is 0, so no episode is held out; "
                                           "hold some out or name a LeRobotDataset root in evaluation.data"),
    ("qwen-image", ["evaluation.data=[DIR]"], "evaluation.data: a Qwen-Image run generates its still squares and "
                                              "reads no data files; leave evaluation.data empty (the held-out data "
                                              "seed is used)"),
    ("wan", ["evaluation.data=[DIR, DIR]"], "evaluation.data names 2 paths; a Wan run reads one (a written dataset "
                                            "or a latent cache, like task.data)"),
])
def test_task_evaluation_settings_are_refused_in_one_line(recipe, overrides, message, tmp_path):
    from loongforge.train.run import run_training

    config = _config(recipe, tmp_path / "run", *EVAL, "training.steps=1",
                     *[o.replace("DIR", str(tmp_path)) for o in overrides])
    with pytest.raises(ConfigError) as refused:
        run_training(config, device="cpu")
    assert str(refused.value) == f"{ROOT / RECIPES[recipe][0]}: {message}"
