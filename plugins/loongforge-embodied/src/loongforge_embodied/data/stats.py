"""Normalisation statistics: compute them from data, merge per-episode ones, and read a dataset's own.

Stats use LeRobot's layout, ``{feature: {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90",
"q99"}}`` with per-dimension numpy arrays, so a dataset's ``meta/stats.json`` and our computed stats are
interchangeable. ``std`` is the population standard deviation (ddof 0) as in LeRobot. Quantiles let policies
such as Pi0.5 normalise actions robustly to outliers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from loongforge_embodied.data.lerobot_format import (
    EPISODES_STATS_JSONL,
    STATS_PATH,
    V21,
    DatasetInfo,
    LeRobotFormatError,
    one_line,
    read_json,
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


#: The stats :func:`aggregate_stats` merges per-episode stats from (v2.1 ships only those).
MERGED = ("min", "max", "mean", "std", "count")


def stats_file(root: Path, info: DatasetInfo) -> Path:
    """Where a dataset keeps the stats it ships: v3.0 ``meta/stats.json``, v2.1 ``meta/episodes_stats.jsonl``."""
    return root / (EPISODES_STATS_JSONL if info.version == V21 else STATS_PATH)


def read_dataset_stats(root: Path, info: DatasetInfo) -> Stats:
    """The stats a dataset ships: v3.0 ``meta/stats.json``; v2.1 ``meta/episodes_stats.jsonl`` merged. A file that
    does not parse, or holds stats that are not finite numbers or not one per value of their feature, is an error
    naming it (and the episode, in v2.1)."""
    path = stats_file(root, info)
    if info.version == V21:
        parts = [_checked(path, f"episode {row.get('episode_index')}: ", row.get("stats"), info)
                 for row in read_jsonl(path)]
        return _merged(path, parts)
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing (compute stats from the data with dataset.compute_stats())")
    return _checked(path, "", read_json(path), info)


def _checked(path: Path, where: str, raw: object, info: DatasetInfo) -> Stats:
    """``{feature: {stat: numbers}}`` as float64 arrays, each finite and, for a numeric feature, with one value per
    element of its shape (``count`` aside; camera stats are per channel and left to their producer)."""
    if not isinstance(raw, dict):
        raise LeRobotFormatError(f"{path}: {where}must map feature names to their stats, got {type(raw).__name__}")
    stats: Stats = {}
    for key, named in raw.items():
        if not isinstance(named, dict) or not named:
            raise LeRobotFormatError(f"{path}: {where}'{key}' must map stat names (mean, std, ...) to numbers")
        size = _values_per_frame(info, key)
        stats[key] = {}
        for name, values in named.items():
            try:
                array = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError):
                raise LeRobotFormatError(f"{path}: {where}'{key}' {name}: not numbers ({values!r:.80})") from None
            if not np.isfinite(array).all():
                raise LeRobotFormatError(f"{path}: {where}'{key}' {name} is not finite ({values!r:.80})")
            if size is not None and name != "count" and array.size != size:
                raise LeRobotFormatError(f"{path}: {where}'{key}' {name} has {array.size} value(s), but the feature "
                                         f"has {size} (shape {info.features[key]['shape']})")
            stats[key][name] = array
    return stats


def _values_per_frame(info: DatasetInfo, key: str) -> int | None:
    """Values per frame of a numeric feature of info.json; ``None`` for cameras and features it does not list."""
    if key not in info.data_keys:
        return None
    return int(np.prod(info.features[key]["shape"], dtype=np.int64))


def _merged(path: Path, parts: list[Stats]) -> Stats:
    """Per-episode stats merged per feature; every episode must give the same features and the stats merged."""
    features = list(parts[0]) if parts else []
    for number, part in enumerate(parts):
        lacking = [f"{key} {name}" for key in features for name in MERGED if name not in part.get(key, {})]
        if sorted(part) != sorted(features) or lacking:
            raise LeRobotFormatError(f"{path}: line {number + 1}: per-episode stats must give {MERGED} for the same "
                                     f"features as the first line ({features}); missing: {lacking or 'features'}")
    try:
        return {key: aggregate_stats(part[key] for part in parts) for key in features}
    except ValueError as err:  # per-episode stats of one feature with different shapes
        raise LeRobotFormatError(f"{path}: per-episode stats do not merge ({one_line(err)})") from None


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    """Stats as JSON-ready nested lists (the layout of ``meta/stats.json``)."""
    return {key: {name: np.asarray(v).tolist() for name, v in s.items()} for key, s in stats.items()}
