"""Every shipped recipe trains: each file in configs/ runs in-process through ``run_training`` exactly as
``loongforge train RECIPE key=value ...`` runs it, with overrides that only make it cheap, and its loss is finite
at every step and falls.

The overrides shrink the run and never swap what the recipe is about: the model, its parts, the dataset, the
tokenizer, the training phase and the strategy stay the recipe's own (``test_cheap_runs_keep_what_the_recipe_is``
refuses an override of those keys). They shrink the model through ``model.overrides`` (same family and
architecture switches, fewer layers or a narrower width), the data (shorter sequences, fewer generated samples or
episodes), and the batch; they turn off what is not training (checkpoints, TensorBoard, samples and evaluations
after training) and hold the learning rate constant and high, so that twelve steps show the loss falling. None of
the recipes asks for a GPU-only feature (fp8, Transformer Engine) or several processes; a recipe that does must
override those keys off here, with a comment saying why, and its layout is covered by the parallel tests.

The falling-loss margin (the mean of the last third of the steps below ``FALLS_BY`` times the mean of the first
third) holds with room on every run seed tried (0-3 and the recipe's own): the worst ratio measured was 0.76.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from loongforge import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
STEPS = 12
#: The last third of the steps must average below this fraction of the first third's loss.
FALLS_BY = 0.85
#: For every recipe: quiet, no checkpoints, metrics at every step, a constant learning rate from step 1.
COMMON = ("logging.progress=false", "logging.tensorboard=false", "logging.interval=1", "training.threads=1",
          "checkpoint.interval=0", "checkpoint.save_at_end=false", "scheduler.warmup_steps=0",
          "scheduler.decay=constant", f"training.steps={STEPS}")
#: What a cheap run may not override: the keys that say what the recipe trains.
IDENTITY = ("model=", "model.name=", "model.encoder=", "model.projector=", "model.foundation=", "model.load=",
            "data.dataset=", "data.tokenizer=", "training.phase=", "parallel.strategy=", "device=")
#: A decoder LLM recipe's model, one layer of width 64 (llama-tiny's family and switches).
SMALL_LLM = ("model.overrides.num_layers=1", "model.overrides.hidden_size=64", "model.overrides.ffn_hidden_size=128",
             "training.sample_tokens=0", "optimizer.lr=1e-2")


@dataclass(frozen=True)
class CheapRun:
    """How one recipe trains in a few seconds."""

    overrides: tuple[str, ...]
    #: Core alone trains it (``nox -s tests_core`` runs it); otherwise it names a first-party plugin's components.
    core: bool = False
    #: It reads Meta-World expert episodes that ``loongforge collect`` writes (the recipe's ``task.data``).
    metaworld_episodes: bool = False
    #: ... filmed by the corner camera at 32 pixels (``--cameras corner --image-size 32``, as the recipe's header).
    metaworld_camera: bool = False
    #: The recipe whose checkpoint it starts from (its ``model.load``, e.g. ``runs/sft-tiny/checkpoints``), which
    #: that recipe's cheap run writes first.
    starts_from: str = ""
    #: A policy-gradient recipe: its loss is no cross-entropy (0 when a group's replies score alike), so the run is
    #: judged by its sampled rewards and log-probs instead of a falling loss.
    rewards: bool = False


#: One row per file in configs/ (a new recipe fails ``test_every_recipe_has_a_cheap_run`` until it has one).
CHEAP = {
    "quickstart.yaml": CheapRun(SMALL_LLM + ("data.seq_length=32", "training.micro_batch_size=2"), core=True),
    "sft-tiny.yaml": CheapRun(SMALL_LLM + ("data.seq_length=64", "training.micro_batch_size=4"), core=True),
    # DPO moves off a trained start: a fifth of the others' step size, and 128 pairs a step (a pair's loss varies
    # far more than a token's) -- ratios 0.74-0.78 over run seeds 0-3 and the recipe's
    "dpo-tiny.yaml": CheapRun(SMALL_LLM + ("optimizer.lr=2e-3", "data.seq_length=96", "training.micro_batch_size=32",
                                           "training.global_batch_size=128", "evaluation.interval=0"),
                              core=True, starts_from="sft-tiny.yaml"),
    "grpo-tiny.yaml": CheapRun(SMALL_LLM + ("data.seq_length=128", "training.micro_batch_size=1",
                                            "training.global_batch_size=2", "grpo.group_size=4",
                                            "grpo.max_new_tokens=8", "evaluation.interval=0"),
                               core=True, starts_from="sft-tiny.yaml", rewards=True),
    "vlm-shapes.yaml": CheapRun(("data.seq_length=96", "training.micro_batch_size=4", "optimizer.lr=1e-2")),
    # the staged recipe: the projector alone for 4 steps, then every part (each part's own rate raised as the
    # others' optimizer.lr is)
    "vlm-staged.yaml": CheapRun(("data.seq_length=96", "training.micro_batch_size=4", "model.projector.lr=1e-2",
                                 "model.encoder.lr=1e-2", "model.foundation.lr=1e-2",
                                 "model.encoder.unfreeze_at_step=4", "model.foundation.unfreeze_at_step=4")),
    # DPO on 12 of the generated pairs (the rest held out), one batch every step: new pairs every step leave a loss
    # too noisy to fall in twelve steps from a 40-step SFT start; on one batch it falls steadily (ratio 0.75,
    # whatever the run seed: the batch is the same)
    "vlm-dpo-shapes.yaml": CheapRun(("data.valid_fraction=0.99", "training.micro_batch_size=12", "optimizer.lr=1e-3",
                                     "evaluation.interval=0"), starts_from="vlm-shapes.yaml"),
    "diffusion-moving-squares.yaml": CheapRun(("model.overrides.num_layers=1", "task.samples=64",
                                               "training.micro_batch_size=8", "task.sample={videos: 0}")),
    "diffusion-squares-image.yaml": CheapRun(("model.overrides.num_layers=1", "task.samples=64",
                                              "training.micro_batch_size=8", "task.sample={images: 0}")),
    "embodied-tiny.yaml": CheapRun(("model.overrides={text_len: 24, depth: 1, vision_depth: 0}",
                                    "task.synthetic={episodes: 6, length: 8}", "task.held_out_episodes=2",
                                    "task.action_horizon=4", "task.eval={frames: 0}", "training.micro_batch_size=32",
                                    "optimizer.lr=1e-2")),
    "embodied-metaworld-reach.yaml": CheapRun(("model.overrides.depth=1", "task.held_out_episodes=1",
                                               "task.action_horizon=4", "task.eval={frames: 0}",
                                               "training.micro_batch_size=32", "optimizer.lr=1e-2"),
                                              metaworld_episodes=True),
    "embodied-reach-fast.yaml": CheapRun(("model.overrides.depth=1", "task.held_out_episodes=1",
                                          "task.action_horizon=4", "task.eval={frames: 0}",
                                          "training.micro_batch_size=32", "optimizer.lr=1e-2"),
                                         metaworld_episodes=True),
    "embodied-metaworld-reach-ki.yaml": CheapRun(("model.overrides.depth=1", "task.held_out_episodes=1",
                                                  "task.action_horizon=4", "task.eval={frames: 0}",
                                                  "training.micro_batch_size=32", "optimizer.lr=1e-2"),
                                                 metaworld_episodes=True),
    "embodied-reach-bins.yaml": CheapRun(("model.overrides.depth=1", "task.held_out_episodes=1",
                                          "task.action_horizon=4", "task.eval={frames: 0}",
                                          "training.micro_batch_size=32", "optimizer.lr=1e-2"),
                                         metaworld_episodes=True),
    "embodied-wam-reach.yaml": CheapRun(("model.overrides.layers=1", "task.held_out_episodes=1",
                                         "task.action_horizon=4", "task.eval={frames: 0}",
                                         "training.micro_batch_size=32", "optimizer.lr=3e-3"),
                                        metaworld_episodes=True, metaworld_camera=True),
}


def test_every_recipe_has_a_cheap_run():
    assert CONFIGS and sorted(p.name for p in CONFIGS) == sorted(CHEAP)


def test_cheap_runs_keep_what_the_recipe_is():
    for name, cheap in CHEAP.items():
        assert not [o for o in cheap.overrides if o.startswith(IDENTITY)], name


@pytest.fixture(scope="module")
def metaworld_episodes(tmp_path_factory) -> Path:
    """Two reach-v3 expert episodes recorded by ``loongforge collect``, as the Meta-World recipe's header says."""
    from loongforge.cli import main

    root = tmp_path_factory.mktemp("metaworld") / "reach-v3"
    assert main(["collect", str(root), "--env", "reach-v3", "--episodes", "2", "--max-steps", "150"]) == 0
    return root


@pytest.fixture(scope="module")
def metaworld_camera_episodes(tmp_path_factory) -> Path:
    """Two reach-v3 expert episodes with the corner camera's 32-pixel frames, as the world-action recipe records.
    A process of its own: MuJoCo picks its GL backend once per process, and the state-only episodes above may have
    imported it without one."""
    root = tmp_path_factory.mktemp("metaworld") / "reach-v3-corner32"
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "collect", str(root), "--env", "reach-v3",
                           "--episodes", "2", "--max-steps", "150", "--cameras", "corner", "--image-size", "32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """``checkpoint_of(recipe)``: a folder holding the recipe's ``run.output_dir`` (``runs/sft-tiny``) as its cheap run
    (40 steps, saved at the end) leaves it: where a recipe that starts from it (``configs/dpo-tiny.yaml``'s
    ``model.load``) looks, from that folder. Each recipe's is trained once per module."""
    from loongforge.train.run import run_training

    made: dict[str, Path] = {}

    def checkpoint(name: str) -> Path:
        if name not in made:
            root = tmp_path_factory.mktemp(f"{Path(name).stem}-first")
            output = root / load_config(ROOT / "configs" / name).run.output_dir
            run_training(load_config(ROOT / "configs" / name, [
                f"run.output_dir={output}", *COMMON, *CHEAP[name].overrides, "training.steps=40",
                "checkpoint.save_at_end=true"]))
            made[name] = root
        return made[name]

    return checkpoint


def _training_rows(run_dir: Path) -> dict[int, dict]:
    """The training metrics of each step (rows without a training loss, such as evaluations', left out)."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row for row in rows if "loss" in row}


@pytest.mark.parametrize("name", [name if cheap.core else pytest.param(name, marks=pytest.mark.needs_plugins)
                                  for name, cheap in CHEAP.items()])
def test_recipe_trains_and_its_loss_falls(tmp_path, request, name):
    from loongforge.train.run import run_training

    cheap = CHEAP[name]
    episodes = "metaworld_camera_episodes" if cheap.metaworld_camera else "metaworld_episodes"
    data = [f"task.data={request.getfixturevalue(episodes)}"] if cheap.metaworld_episodes else []
    if cheap.starts_from:  # model.load: runs/sft-tiny/checkpoints, relative to where the command runs
        request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("checkpoint_of")(cheap.starts_from))
    out = tmp_path / "run"
    config = load_config(ROOT / "configs" / name, [f"run.output_dir={out}", *COMMON, *cheap.overrides, *data])
    summary = run_training(config)
    assert summary["steps"] == STEPS
    rows = _training_rows(out)
    assert sorted(rows) == list(range(1, STEPS + 1))
    if cheap.rewards:
        for row in rows.values():
            assert 0 <= row["rl/reward_mean"] <= 1 and row["rl/reply_length"] > 0
            assert 0 <= row["rl/logprob_diff_max"] < 1e-4 and math.isfinite(row["loss"])
        return
    losses = [rows[step]["loss"] for step in sorted(rows)]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses), losses
    assert all(math.isfinite(rows[step]["grad_norm"]) for step in rows)
    third = STEPS // 3
    assert sum(losses[-third:]) < FALLS_BY * sum(losses[:third]), losses
