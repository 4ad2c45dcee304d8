"""Small synthetic episodes for tests and demos: smooth states and actions, and camera frames in which every
frame of an episode differs clearly from its neighbours (a moving square over a drifting gradient), so a
reader that returns the wrong frame is caught even through lossy video compression.

``loongforge make-data synthetic-episodes ROOT [--version v3.0] [--codec h264] [--lengths 12 15 10] [--subtasks]
[--lerobot-version 0.6]`` writes such a set from the command line (no downloads).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from loongforge.errors import LoongForgeError

from loongforge_embodied.data.lerobot_format import INFO_PATH
from loongforge_embodied.data.lerobot_writer import LEROBOT_04, EpisodeData, VideoOptions, write_lerobot_dataset

#: The tiny dataset the tests use: 3 episodes, an episode boundary inside a v3.0 file and one across files.
TINY_LENGTHS = (12, 15, 10)
#: The two subtasks of :func:`with_subtasks`.
SUBTASKS = ("move to the object", "bring it back")


def synthetic_frame(episode: int, t: int, size: int) -> np.ndarray:
    """(size, size, 3) uint8: a gradient that brightens with ``t`` plus a 4x4 square placed by ``t``."""
    yy, xx = np.mgrid[0:size, 0:size]
    image = np.stack(
        [40 + xx * 120 // size + 3 * t, 60 + yy * 120 // size + 10 * episode, np.full_like(xx, 90 + 4 * t)], axis=-1
    )
    cells = max(1, (size - 4) // 2 + 1)
    row, col = 2 * (t % cells), 2 * ((t // cells + episode) % cells)
    image[row:row + 4, col:col + 4] = 230
    return np.clip(image, 0, 255).astype(np.uint8)


def synthetic_episodes(
    lengths: Sequence[int],
    *,
    state_dim: int = 4,
    action_dim: int = 3,
    image_size: int = 16,
    cameras: Sequence[str] = ("observation.images.top",),
    seed: int = 0,
) -> list[EpisodeData]:
    """Episodes of the given lengths; tasks alternate between two texts so task indexing is exercised."""
    rng = np.random.default_rng(seed)
    episodes = []
    for e, length in enumerate(lengths):
        walk = np.cumsum(rng.normal(0, 0.1, (length, state_dim + action_dim)), axis=0).astype(np.float32)
        frames = {cam: np.stack([synthetic_frame(e + 3 * c, t, image_size) for t in range(length)])
                  for c, cam in enumerate(cameras)}
        episodes.append(EpisodeData(
            task=("pick up the red cube", "open the drawer")[e % 2],
            features={"observation.state": walk[:, :state_dim], "action": walk[:, state_dim:]},
            cameras=frames,
        ))
    return episodes


def with_subtasks(episodes: Sequence[EpisodeData], fps: int) -> list[EpisodeData]:
    """``episodes`` annotated with two subtasks each: the first half of its frames, then the rest."""
    return [replace(ep, subtasks=[(0.0, SUBTASKS[0]), ((ep.length // 2) / fps, SUBTASKS[1])]) for ep in episodes]


def write_synthetic_dataset(
    root: str | Path, *, version: str, codec: str = "h264", lengths: Sequence[int] = TINY_LENGTHS, fps: int = 10,
    subtasks: bool = False, lerobot: str = LEROBOT_04,
) -> tuple[Path, list[EpisodeData]]:
    """Write :func:`synthetic_episodes` (with :func:`with_subtasks` when ``subtasks``) as a LeRobotDataset (v3.0:
    two episodes per file) the way LeRobot release ``lerobot`` writes it; returns the root and the episodes, the
    ground truth a reader is compared with."""
    episodes = synthetic_episodes(lengths)
    episodes = with_subtasks(episodes, fps) if subtasks else episodes
    path = write_lerobot_dataset(root, episodes, fps=fps, version=version, video=VideoOptions(codec=codec),
                                 episodes_per_file=2, lerobot=lerobot)
    return path, episodes


def run(args: argparse.Namespace) -> int:
    """``loongforge make-data synthetic-episodes ROOT``: write the set and print one line (options:
    :func:`loongforge_embodied.commands.configure_synthetic_episodes`)."""
    if (Path(args.root) / INFO_PATH).exists():
        raise LoongForgeError(f"{args.root} already holds a LeRobotDataset; choose a new directory or delete it")
    lengths = args.lengths or TINY_LENGTHS
    root, episodes = write_synthetic_dataset(args.root, version=args.version, codec=args.codec, lengths=lengths,
                                             fps=args.fps, subtasks=args.subtasks, lerobot=args.lerobot_version)
    writer = f" as LeRobot {args.lerobot_version} writes it" if args.lerobot_version != LEROBOT_04 else ""
    print(f"wrote {len(episodes)} episodes ({sum(lengths)} frames at {args.fps} fps, LeRobot {args.version}{writer}, "
          f"{args.codec}) to {root}")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit(
        "python -m loongforge_embodied.data.synthetic is now `loongforge make-data synthetic-episodes ROOT ...`")
