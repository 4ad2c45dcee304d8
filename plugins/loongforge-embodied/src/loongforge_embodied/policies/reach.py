"""A learnable synthetic LeRobot set: a point agent reaches either a red square seen only in the camera image or
the centre, as its task text says, so a policy must read the image, the text and the state to act well.

Positions are in pixels of the camera image (so errors read in pixels squared). Actions are a proportional
controller, ``a_t = gain * (goal - s_t)`` with ``s_{t+1} = s_t + a_t``: an action
chunk is a deterministic function of (state, goal), and held-out episodes (new targets and starts) measure
whether a policy learned it rather than memorised frames. The demo set of the LeRobot reader
(:mod:`loongforge_embodied.data.synthetic`) is a random walk, which no policy can predict.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loongforge_embodied.data.lerobot_writer import EpisodeData, VideoOptions, write_lerobot_dataset, write_once

TASKS = ("reach the red square", "go back to the centre")
CAMERA = "observation.images.top"
#: The widths of the set's states and actions: a position and a move in the image plane.
STATE_DIM = ACTION_DIM = 2
SQUARE = 3


def reach_episode(index: int, rng: np.random.Generator, *, length: int, image_size: int,
                  gain: float) -> EpisodeData:
    """One episode; even indices reach the square, odd ones go to the centre (the square is then a distractor)."""
    corner = rng.integers(0, image_size - SQUARE + 1, size=2)
    target = corner + SQUARE / 2
    goal = target if index % 2 == 0 else np.full(2, image_size / 2)
    position = rng.uniform(0.5, image_size - 0.5, size=2)
    states, actions, frames = [], [], []
    for _ in range(length):
        action = gain * (goal - position)
        image = np.full((image_size, image_size, 3), 30, np.uint8)
        image[corner[1]:corner[1] + SQUARE, corner[0]:corner[0] + SQUARE] = (220, 30, 30)
        px = np.clip(position.astype(int), 0, image_size - 1)
        image[px[1], px[0]] = (40, 90, 230)
        states.append(position.copy())
        actions.append(action)
        frames.append(image)
        position = position + action
    return EpisodeData(task=TASKS[index % 2],
                       features={"observation.state": np.asarray(states, np.float32),
                                 "action": np.asarray(actions, np.float32)},
                       cameras={CAMERA: np.stack(frames)})


def write_reach_dataset(root: str | Path, *, episodes: int, length: int = 20, image_size: int = 16,
                        gain: float = 0.2, seed: int = 0, fps: int = 10) -> Path:
    """Write the set (LeRobot v3.0, PNG cameras) unless ``root`` already holds it; safe when several ranks race
    (each writes a private directory and renames it into place; the losers drop theirs)."""
    root = Path(root)
    if (root / "meta" / "info.json").is_file():
        return root
    rng = np.random.default_rng(seed)
    data = [reach_episode(i, rng, length=length, image_size=image_size, gain=gain) for i in range(episodes)]
    return write_once(root, lambda tmp: write_lerobot_dataset(tmp, data, fps=fps, version="v3.0",
                                                              video=VideoOptions(codec="png")))
