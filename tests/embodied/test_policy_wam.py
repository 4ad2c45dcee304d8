"""The world-action model (``wam-*``, Wan DiT blocks denoising future frame latents and the action chunk together):
``loongforge train configs/embodied-wam-reach.yaml`` on a camera set makes both flow-matching losses fall on held-out
frames (and with ``task.action_loss_weight=0`` the action loss stays where it started), acting returns chunks of the
policy's shape with the frames it imagined, and a closed-loop evaluation with ``--videos`` writes those frames beside
each rollout.

The data is the synthetic reach set (16-pixel PNG camera, a point agent moving towards a target), so no simulator is
needed; the closed loop runs the real evaluator over a stand-in environment that renders the same kind of frame."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from loongforge.cli import main
from loongforge.train.task_checkpoint import load_task_model
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
STEPS = 45
#: The recipe on the synthetic set at test size: 16-pixel frames as 8x8 latents, one narrow block.
CHEAP = ["logging.progress=false", "logging.tensorboard=false", "logging.interval=1", "training.threads=1",
         f"training.steps={STEPS}", "training.micro_batch_size=8", "checkpoint.interval=0",
         "checkpoint.save_at_end=true", "scheduler.warmup_steps=0", "scheduler.decay=constant", "optimizer.lr=3e-3",
         "model.overrides={image_size: 16, latent_size: 8, dim: 32, heads: 2, layers: 1, ffn_dim: 64, "
         "max_state_dim: 4, max_action_dim: 4}",
         "task.data=null", "task.synthetic={episodes: 6, length: 12}", "task.held_out_episodes=2",
         "task.action_horizon=4", "task.frame_stride=2", "task.eval={frames: 8, steps: 3}"]


def _train(out: Path, *overrides: str) -> Path:
    config = str(ROOT / "configs" / "embodied-wam-reach.yaml")
    before = torch.get_num_threads()
    try:
        assert main(["train", config, f"run.output_dir={out}", *CHEAP, *overrides]) == 0
    finally:
        torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("wam") / "run")


def _held_out_terms(run: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The held-out loss terms of the trained model and of a freshly built one, on the same frames and draws."""
    task, model, _ = load_task_model(run / "checkpoints")
    frames = task.validation_dataset([], 16)
    batch = {key: torch.stack([frames[i][key] for i in range(len(frames))]) for key in frames[0]}

    def terms(policy: torch.nn.Module) -> dict[str, float]:
        generators = [torch.Generator().manual_seed(i) for i in range(len(frames))]
        with torch.no_grad():
            return {name: float(value) for name, value in task.loss_terms(policy.eval(), batch, generators).items()}

    torch.manual_seed(0)
    return terms(model), terms(task.build_model())


def test_training_makes_both_losses_fall(trained):
    after, before = _held_out_terms(trained)
    assert set(after) == {"video", "action"}
    assert after["video"] < 0.5 * before["video"], (before, after)
    assert after["action"] < 0.8 * before["action"], (before, after)
    scores = json.loads((trained / "eval.json").read_text())
    assert scores["held_out_loss_terms"].keys() == {"video", "action"}
    assert set(scores["held_out_frame_mse"]) == {"model", "still_baseline"}
    gif = Image.open(trained / scores["predicted_frames"])
    # one frame per chunk start of the first held-out episode (12 frames, stride 2); the observed frame and 2
    # future frames of 64 pixels a side, recorded above predicted
    assert (gif.n_frames, gif.size) == (6, (3 * 64, 2 * 64))


def test_without_the_action_loss_actions_are_not_learned(tmp_path):
    """The mutant the first test must catch: ``action_loss_weight: 0`` leaves the action error where it began."""
    after, before = _held_out_terms(_train(tmp_path / "run", "training.steps=10", "task.action_loss_weight=0"))
    assert after["video"] < 0.7 * before["video"]
    assert after["action"] == pytest.approx(before["action"], rel=1e-6)


class _StandInEnv:
    """An environment as the evaluator asks for it (``sim.environment.SimEnvironment``), over a 2-d point world
    filmed as the reach set is: the state is a position, an action moves it, success is never reached (every
    episode runs ``max_steps``)."""

    max_steps, fps, action_dim, robot_type, video_camera = 500, 80, 2, "point", "corner"

    def __init__(self, name: str, *, cameras, image_size: int) -> None:
        self.task, self.cameras, self.size = "reach the red square", cameras, image_size
        self.position = np.zeros(2)

    def _observe(self, reward: float = 0.0):
        from loongforge_embodied.sim.environment import Observation

        return Observation(self.position.copy(), {cam: self.render(cam, self.size) for cam in self.cameras}, reward)

    def reset(self, seed: int):
        self.position = np.random.default_rng(seed).uniform(2, 14, 2)
        return self._observe()

    def step(self, action):
        self.position = np.clip(self.position + np.asarray(action[:2]), 0, 15)
        return self._observe(1.0), False

    def render(self, camera: str, size: int) -> np.ndarray:
        image = np.full((size, size, 3), 30, np.uint8)
        x, y = (self.position * size / 16).astype(int)
        image[y, x] = (40, 90, 230)
        return image

    def close(self) -> None:
        pass


def test_acting_returns_chunks_and_the_evaluation_films_imagined_frames(trained, tmp_path, monkeypatch):
    from loongforge_embodied.sim import evaluate as evaluation
    from loongforge_embodied.sim.policy import CheckpointPolicy
    from loongforge_embodied.sim.recording import RolloutRecorder

    policy = CheckpointPolicy(trained / "checkpoints", steps=3)
    states = np.array([[3.0, 4.0], [10.0, 12.0]])
    images = [{"observation.images.top": _StandInEnv("", cameras=(), image_size=16).render("top", 16)}] * 2
    chunks = policy.act_batch("reach the red square", states, images, seeds=[5, 6])
    assert chunks.shape == (2, 4, 2) and np.isfinite(chunks).all()
    frames = policy.predicted_frames
    assert frames.shape == (2, 2, 16, 16, 3) and frames.dtype == np.uint8
    # a row's chunk and frames are the ones it gets alone (its own noise seed)
    alone = policy.act_batch("reach the red square", states[1:], images[1:], seeds=[6])
    np.testing.assert_allclose(alone[0], chunks[1], atol=1e-5)
    assert np.abs(policy.predicted_frames[0].astype(int) - frames[1].astype(int)).max() <= 1

    monkeypatch.setattr(evaluation, "make_env", lambda name, *, cameras, image_size: _StandInEnv(
        name, cameras=cameras, image_size=image_size))
    recorder = RolloutRecorder(tmp_path / "videos", size=32, format="gif")
    summary = evaluation.evaluate(policy, "reach-v3", [7, 8], replan=2, max_steps=6, recorder=recorder, batch=2)
    for index, row in enumerate(summary["per_episode"]):
        assert not row["success"] and row["steps"] == 6
        video = Image.open(row["predicted_video"])
        assert Path(row["predicted_video"]).name == f"episode-{index:03d}-failure-predicted.gif"
        # one strip per chunk (6 steps, 2 actions a chunk): the observed frame and 2 predicted ones, 32 pixels each
        assert (video.n_frames, video.size) == (3, (3 * 32, 32))
