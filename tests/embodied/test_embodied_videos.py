"""Rollout videos and the success summary of ``loongforge eval`` in closed loop: a tiny policy trained by
``loongforge train`` is evaluated with rendering on, as a user runs it (a fresh process, no MUJOCO_GL set, no
display: the evaluator picks EGL itself), and every episode leaves one video of the right length and size, named
by its outcome, next to a ``summary.json`` whose numbers are the printed table's."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from loongforge_embodied.sim.evaluate import evaluate
from loongforge_embodied.sim.policy import CheckpointPolicy
from PIL import Image, ImageSequence

pytestmark = [pytest.mark.needs_plugins, pytest.mark.slow]

SEEDS, FIRST_SEED, MAX_STEPS, REPLAN, SIZE = 2, 1000, 6, 2, 32
#: A printed table row: episode, seed, result, steps, return, video.
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(success|failure)\s+(\d+)\s+(-?[\d.]+)\s+(\S+)$")


def run_eval(source: Path | str, out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("MUJOCO_GL", "DISPLAY")}
    done = subprocess.run(
        [sys.executable, "-m", "loongforge.cli", "eval", str(source), "--env", "reach-v3", "--seeds", str(SEEDS),
         "--first-seed", str(FIRST_SEED), "--max-steps", str(MAX_STEPS), "--replan", str(REPLAN), "--steps", "2",
         "--out", str(out), "--video-size", str(SIZE), *options],
        capture_output=True, text=True, timeout=300,
        env={**env, "OMP_NUM_THREADS": "1", "LOONGFORGE_PROGRESS": "plain"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def printed_rows(stdout: str) -> list[tuple]:
    return [match.groups() for line in stdout.splitlines() if (match := ROW.match(line))]


def mp4_frames(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def gif_frames(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "GIF"
        return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)])


@pytest.fixture(scope="module")
def mp4_run(metaworld_checkpoint, tmp_path_factory):
    """``loongforge eval CKPT ... --videos``: mp4 files under ``<out>/videos``."""
    out = tmp_path_factory.mktemp("eval-mp4") / "eval"
    done = run_eval(metaworld_checkpoint, out, "--videos")
    return out, json.loads((out / "summary.json").read_text()), done.stdout


def test_one_mp4_per_episode_and_a_summary_that_matches_the_table(mp4_run):
    out, summary, stdout = mp4_run
    assert set(summary) == {"policy"}
    result = summary["policy"]
    rows = result["per_episode"]
    assert [row["seed"] for row in rows] == result["seeds"] == list(range(FIRST_SEED, FIRST_SEED + SEEDS))
    assert result["episodes"] == len(rows) == SEEDS
    assert result["successes"] == sum(row["success"] for row in rows)
    assert result["success_rate"] == result["successes"] / SEEDS
    assert result["mean_length"] == pytest.approx(np.mean([row["steps"] for row in rows]))
    assert result["mean_return"] == pytest.approx(np.mean([row["return"] for row in rows]))
    assert all(1 <= row["steps"] <= MAX_STEPS and (row["success"] or row["steps"] == MAX_STEPS) for row in rows)

    # one video per episode, named by its index and outcome, and nothing else
    assert sorted(p.name for p in (out / "videos").iterdir()) == [
        f"episode-{i:03d}-{'success' if row['success'] else 'failure'}.mp4" for i, row in enumerate(rows)]
    for i, row in enumerate(rows):
        assert row["video"] == f"videos/episode-{i:03d}-{'success' if row['success'] else 'failure'}.mp4"
        frames = mp4_frames(out / row["video"])
        assert frames.shape == (row["steps"] + 1, SIZE, SIZE, 3)  # the reset frame and one per step
        assert frames.std() > 10  # a rendered scene, not a blank frame
        assert np.abs(frames[-1].astype(int) - frames[0]).max() > 0  # the arm moved

    # the printed table and totals carry the summary's numbers
    printed = printed_rows(stdout)
    assert [(int(i), int(seed), result_, int(steps), video) for i, seed, result_, steps, _, video in printed] == [
        (i, row["seed"], "success" if row["success"] else "failure", row["steps"], row["video"])
        for i, row in enumerate(rows)]
    for (*_, ret, _), row in zip(printed, rows, strict=True):
        assert float(ret) == pytest.approx(row["return"], abs=0.005)
    assert (f"policy success rate: {result['success_rate']:.0%} ({result['successes']}/{SEEDS}) on reach-v3 seeds "
            f"{FIRST_SEED}..{FIRST_SEED + SEEDS - 1}; mean return {result['mean_return']:.2f}, mean length "
            f"{result['mean_length']:.1f} steps") in stdout
    # progress per episode, with the running success rate as its note
    assert re.search(rf"pi0-tiny on reach-v3: {SEEDS}/{SEEDS} episode .*\[success {result['successes']}/{SEEDS} ",
                     stdout)


def test_gif_videos_elsewhere_show_the_same_episodes(mp4_run, metaworld_checkpoint, tmp_path):
    """``--video-format gif --video-dir DIR --baseline random --batch 1 --trackers csv``: GIFs of the policy's
    episodes in DIR with the same frames as the mp4 run (which ran its episodes side by side), the baseline's in
    DIR/random, episodes equal to an evaluation that renders nothing, and both policies' totals in the tracker at
    the checkpoint's step."""
    mp4_out, mp4_summary, _ = mp4_run
    videos = tmp_path / "gifs"
    run_eval(metaworld_checkpoint, tmp_path / "eval", "--video-format", "gif", "--video-dir", str(videos),
             "--baseline", "random", "--batch", "1", "--trackers", "csv")
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert set(summary) == {"policy", "random"}
    assert summary["random"]["episodes"] == SEEDS and summary["random"]["successes"] == 0
    for row in summary["random"]["per_episode"]:  # the baseline is filmed too, beside the policy
        assert Path(row["video"]).parent == videos / "random"
        assert gif_frames(Path(row["video"])).shape == (row["steps"] + 1, SIZE, SIZE, 3)
    with open(tmp_path / "eval" / "metrics.csv", newline="") as handle:
        (logged,) = list(csv.DictReader(handle))
    assert logged["step"] == "4"  # the checkpoint was trained 4 steps
    for name in ("policy", "random"):
        for metric in ("success_rate", "mean_return", "mean_length", "episodes"):
            assert float(logged[f"eval/{name}/{metric}"]) == pytest.approx(summary[name][metric])
    rows = summary["policy"]["per_episode"]
    assert sorted(p.name for p in videos.iterdir() if p.is_file()) == [
        f"episode-{i:03d}-{'success' if row['success'] else 'failure'}.gif" for i, row in enumerate(rows)]
    for row, mp4_row in zip(rows, mp4_summary["policy"]["per_episode"], strict=True):
        assert Path(row["video"]).parent == videos  # outside --out: given as written
        gif = gif_frames(Path(row["video"]))
        assert gif.shape == (row["steps"] + 1, SIZE, SIZE, 3)
        # the same rendering, through a 256-colour palette on one side and H.264 on the other
        mp4 = mp4_frames(mp4_out / mp4_row["video"])
        assert np.abs(gif.astype(float) - mp4).mean() < 6
    # recording (in any format) does not change what the policy does: the same episodes as the mp4 run's (side by
    # side there, so a batched matmul may move the last bits of a return), and as an evaluation that renders nothing
    # (in this process, whose thread count may too)
    mp4_rows = mp4_summary["policy"]["per_episode"]
    assert [(r["seed"], r["success"], r["steps"]) for r in rows] == [
        (r["seed"], r["success"], r["steps"]) for r in mp4_rows]
    assert [r["return"] for r in rows] == pytest.approx([r["return"] for r in mp4_rows], rel=1e-6)
    plain = evaluate(CheckpointPolicy(metaworld_checkpoint, steps=2), "reach-v3",
                     list(range(FIRST_SEED, FIRST_SEED + SEEDS)), replan=REPLAN, max_steps=MAX_STEPS)
    assert [(r["seed"], r["success"], r["steps"]) for r in plain["per_episode"]] == [
        (r["seed"], r["success"], r["steps"]) for r in rows]
    assert [r["return"] for r in plain["per_episode"]] == pytest.approx([r["return"] for r in rows], rel=1e-6)
