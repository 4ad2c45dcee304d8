"""The embodied plugin's commands as a user runs them: ``loongforge make-data synthetic-episodes`` (what used to be
``python -m loongforge_embodied.data.synthetic``), ``loongforge collect`` with progress, the rollout writer, and the
one-line errors of ``loongforge eval`` (bad video options, unknown task, no server, rendering off)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from loongforge.cli import main
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.synthetic import synthetic_episodes
from loongforge_embodied.sim.recording import RolloutRecorder
from PIL import Image, ImageSequence

pytestmark = pytest.mark.needs_plugins


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_make_data_synthetic_episodes_writes_the_generated_set(tmp_path, capsys, version):
    root = tmp_path / "demo"
    assert main(["make-data", "synthetic-episodes", str(root), "--version", version, "--codec", "png",
                 "--lengths", "3", "5", "--fps", "8"]) == 0
    assert f"wrote 2 episodes (8 frames at 8 fps, LeRobot {version}, png) to {root}" in capsys.readouterr().out
    dataset = LeRobotDataset(root, action_horizon=2)
    assert (dataset.num_episodes, dataset.fps, len(dataset)) == (2, 8, 8)
    assert [ep.length for ep in dataset.episodes] == [3, 5]
    truth = synthetic_episodes([3, 5])  # what the generator wrote, frame for frame
    for ep, want in zip(dataset.episodes, truth, strict=True):
        for t in range(ep.length):
            item = dataset[ep.start + t]
            assert item["task"] == want.task
            np.testing.assert_array_equal(item["observation.state"], want.features["observation.state"][t])
            np.testing.assert_array_equal(item["action"][0], want.features["action"][t])
            image = np.round(item["observation.images.top"].transpose(1, 2, 0) * 255).astype(np.uint8)
            np.testing.assert_array_equal(image, want.cameras["observation.images.top"][t])  # PNG: lossless


def test_make_data_refuses_an_existing_set_and_bad_lengths(tmp_path, capsys):
    root = tmp_path / "demo"
    assert main(["make-data", "synthetic-episodes", str(root), "--lengths", "4"]) == 0
    assert main(["make-data", "synthetic-episodes", str(root), "--lengths", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {root} already holds a LeRobotDataset; choose a new directory or delete it"]
    with pytest.raises(SystemExit) as done:
        main(["make-data", "synthetic-episodes", str(tmp_path / "other"), "--lengths", "3", "0"])
    assert done.value.code == 2 and "--lengths: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_make_data_lists_the_generator(capsys):
    with pytest.raises(SystemExit):
        main(["make-data", "--help"])
    assert "synthetic-episodes" in capsys.readouterr().out


def test_collect_shows_progress_per_episode(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    assert main(["collect", str(tmp_path / "set"), "--env", "reach-v3", "--episodes", "1", "--max-steps", "150",
                 "--tail", "1"]) == 0
    printed = capsys.readouterr().out
    assert "collecting reach-v3 expert episodes: 1/1 episode" in printed
    assert "[seed 0: success at step " in printed
    assert "wrote 1 reach-v3 episodes" in printed


class PaintedEnv:
    """Stands in for the simulator: ``render`` paints frame ``n`` with the value ``40 * n`` (a few colours, which a
    GIF palette keeps exactly)."""

    video_camera = "corner"

    def __init__(self) -> None:
        self.frames = 0

    def render(self, camera: str, size: int) -> np.ndarray:
        self.frames += 1
        return np.full((size, size, 3), 40 * (self.frames - 1), np.uint8)


@pytest.mark.parametrize("video_format", ["gif", "mp4"])
def test_recorder_writes_each_episode_under_its_outcome(tmp_path, video_format):
    recorder = RolloutRecorder(tmp_path, size=16, format=video_format)
    env = PaintedEnv()
    for _ in range(4):
        recorder.capture(env, 3)
    first = recorder.finish(3, True)
    recorder.capture(env, 4)
    recorder.capture(env, 4)
    second = recorder.finish(4, False)
    assert (first.name, second.name) == (f"episode-003-success.{video_format}", f"episode-004-failure.{video_format}")
    if video_format == "gif":
        with Image.open(first) as image:
            frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]
            assert image.info["duration"] == 50  # 20 fps
        assert [int(frame[0, 0, 0]) for frame in frames] == [0, 40, 80, 120]
        assert all(frame.shape == (16, 16, 3) for frame in frames)
    else:
        import av

        with av.open(str(second)) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert len(frames) == 2 and frames[0].shape == (16, 16, 3)
        assert [round(float(frame.mean()) / 40) for frame in frames] == [4, 5]  # the second episode's frames


@pytest.mark.parametrize(("options", "error"), [
    (["--videos", "--video-size", "33"], "--video-size 33 is odd; H.264 (mp4) needs an even frame side"),
    (["--env", "no-such-v3"], "unknown Meta-World task 'no-such-v3'; known: assembly-v3, "),
    (["--replan", "0"], "--replan 0 must be between 1 and the policy's horizon 10"),
    (["--max-steps", "501"], "--max-steps 501 must be between 1 and reach-v3's limit 500"),
    (["--seeds", "0"], "--seeds 0 must be at least 1 (the number of episodes)"),
    (["--first-seed", "-1"], "--first-seed -1 --seeds 1 gives seeds -1..-1; seeds must lie in 0.."),
    (["--first-seed", str(2**32 - 1), "--seeds", "2"], f"--first-seed {2**32 - 1} --seeds 2 gives seeds"),
    (["--batch", "0"], "--batch 0 must be at least 1 (episodes run side by side)"),
    (["--threads", "0"], "--threads 0 must be at least 1"),
    (["--trackers", "neptune"], "--trackers: unknown tracker 'neptune'; known: csv, mlflow, tensorboard, wandb"),
])
def test_eval_option_errors_are_one_line(tmp_path, capsys, options, error):
    assert main(["eval", "random", "--seeds", "1", "--out", str(tmp_path / "eval"), *options]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {error}")
    assert not (tmp_path / "eval").exists()


def test_eval_of_an_unreachable_server_is_one_line(capsys):
    assert main(["eval", "ws://127.0.0.1:9", "--seeds", "1"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: cannot connect to the policy server at ws://127.0.0.1:9")


def test_videos_without_rendering_are_one_line(tmp_path):
    """``MUJOCO_GL=disable`` (MuJoCo's own "no OpenGL"): the evaluator says that it cannot film, and how to fix it,
    in one line and without a traceback."""
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "eval", "random", "--seeds", "1", "--max-steps",
                           "2", "--videos", "--out", str(tmp_path / "eval")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MUJOCO_GL": "disable", "LOONGFORGE_PROGRESS": "off"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: cannot render Meta-World cameras: MUJOCO_GL=disable turns rendering off; set MUJOCO_GL=egl (GPU "
        "driver or Mesa's EGL) or MUJOCO_GL=osmesa (apt-get install libosmesa6), or run without cameras and videos"]
