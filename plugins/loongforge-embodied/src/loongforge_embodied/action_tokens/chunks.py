"""Action chunks of a LeRobotDataset, to fit and measure a tokenizer on: every window of ``horizon`` consecutive
actions inside one episode (no padding: a repeated last action would teach the tokenizer chunks no robot made),
every ``stride`` frames. Reads the parquet columns only; no video is decoded."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loongforge_embodied.action_tokens.base import ActionTokenizerError
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset


def action_chunks(dataset: LeRobotDataset | str | Path, horizon: int, *, stride: int = 1,
                  episodes: Sequence[int] | None = None, key: str = "action") -> np.ndarray:
    """``(N, horizon, D)`` float64 windows of ``key`` from ``episodes`` (episode indices; default all)."""
    if horizon < 1 or stride < 1:
        raise ActionTokenizerError(f"horizon and stride must be at least 1, got {horizon} and {stride}")
    data = dataset if isinstance(dataset, LeRobotDataset) else LeRobotDataset(dataset)
    if key not in data.columns:
        raise ActionTokenizerError(f"{data.root}: no '{key}' column (features: {list(data.info.features)})")
    values = np.asarray(data.columns[key], dtype=np.float64)
    values = values[:, None] if values.ndim == 1 else values
    wanted = None if episodes is None else set(episodes)
    starts = [start for ep in data.episodes if wanted is None or ep.index in wanted
              for start in range(ep.start, ep.start + ep.length - horizon + 1, stride)]
    if not starts:
        raise ActionTokenizerError(f"{data.root}: no episode (of those asked) has {horizon} frames for one chunk")
    return np.stack([values[start:start + horizon] for start in starts])
