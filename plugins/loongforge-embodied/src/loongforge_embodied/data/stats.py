"""Normalisation statistics: compute them from data, merge per-episode ones, and read a dataset's own.

Stats use LeRobot's layout, ``{feature: {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90",
"q99"}}`` with per-dimension numpy arrays, so a dataset's ``meta/stats.json`` and our computed stats are
interchangeable. ``std`` is the population standard deviation (ddof 0) as in LeRobot. Quantiles let policies
such as Pi0.5 normalise actions robustly to outliers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from loongforge_embodied.data.lerobot_format import (
    EPISODES_STATS_JSONL,
    STATS_PATH,
    V21,
    DatasetInfo,
    LeRobotFormatError,
    read_jsonl,
)

Stats = dict[str, dict[str, np.ndarray]]

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def compute_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Per-dimension stats of ``values`` (N, ...) over the first axis, in float64."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        values = values[:, None]
    stats = {
        "min": values.min(axis=0),
        "max": values.max(axis=0),
        "mean": values.mean(axis=0),
        "std": values.std(axis=0),
        "count": np.array([len(values)]),
    }
    stats.update({name: np.quantile(values, q, axis=0) for name, q in QUANTILES.items()})
    return stats


def aggregate_stats(parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Merge stats of disjoint parts (episodes) of one feature.

    min/max/mean/std/count are exact (the parallel-variance formula). Quantiles cannot be merged exactly
    from summaries; they are the count-weighted mean of the parts' quantiles, as LeRobot does. Compute from
    the data (:func:`compute_stats`) when exact quantiles matter.
    """
    parts = [{k: np.asarray(v, dtype=np.float64) for k, v in p.items()} for p in parts]
    counts = np.array([float(p["count"].reshape(-1)[0]) for p in parts])
    weights = (counts / counts.sum()).reshape(-1, *([1] * parts[0]["mean"].ndim))
    means = np.stack([p["mean"] for p in parts])
    mean = (weights * means).sum(axis=0)
    variance = (weights * (np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2)).sum(axis=0)
    merged = {
        "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
        "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
        "mean": mean,
        "std": np.sqrt(variance),
        "count": np.array([int(counts.sum())]),
    }
    for name in QUANTILES:
        if all(name in p for p in parts):
            merged[name] = (weights * np.stack([p[name] for p in parts])).sum(axis=0)
    return merged


def read_dataset_stats(root: Path, info: DatasetInfo) -> Stats:
    """The stats a dataset ships: v3.0 ``meta/stats.json``; v2.1 ``meta/episodes_stats.jsonl`` merged."""
    if info.version == V21:
        rows = read_jsonl(root / EPISODES_STATS_JSONL)
        features = rows[0]["stats"].keys() if rows else ()
        return {key: aggregate_stats(row["stats"][key] for row in rows) for key in features}
    path = root / STATS_PATH
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing (compute stats from the data with dataset.compute_stats())")
    return {key: {k: np.asarray(v, dtype=np.float64) for k, v in s.items()}
            for key, s in json.loads(path.read_text()).items()}


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    """Stats as JSON-ready nested lists (the layout of ``meta/stats.json``)."""
    return {key: {name: np.asarray(v).tolist() for name, v in s.items()} for key, s in stats.items()}
