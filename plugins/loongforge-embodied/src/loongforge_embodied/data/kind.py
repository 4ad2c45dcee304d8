"""The ``lerobot`` dataset kind: ``data.dataset: lerobot`` with ``data.paths: [<dataset root>]``.

Core calls dataset kinds as ``factory(paths, tokenizer, *, text_key, cache_dir, progress, **options)``; a
LeRobot dataset needs none of the text arguments (task text is tokenized by the policy), so they are accepted
and unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loongforge_embodied.data.lerobot_dataset import LeRobotDataset


def lerobot_dataset(
    paths: Sequence[str | Path],
    tokenizer: Any = None,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    action_horizon: int | None = None,
    delta_timestamps: dict[str, list[float]] | None = None,
    episodes: list[int] | None = None,
) -> LeRobotDataset:
    """The LeRobotDataset (v2.1 or v3.0) at the one path given."""
    if len(paths) != 1:
        raise ValueError(f"dataset 'lerobot' takes exactly one dataset root, got {len(paths)} paths")
    return LeRobotDataset(paths[0], action_horizon=action_horizon, delta_timestamps=delta_timestamps,
                          episodes=episodes)
