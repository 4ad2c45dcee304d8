"""A map-style reader of LeRobotDataset v2.1 and v3.0 directories: item ``i`` is frame ``i`` of the dataset.

An item has what a VLA policy trains on: the frame's low-dimensional features (``observation.state``, ...),
its camera images (decoded from mp4 at the frame's timestamp, or from PNG cells of the parquet), the task
text, and windows of future (or past) values asked for by ``delta_timestamps`` -- typically an action chunk
``action[t : t + H]`` with ``action_is_pad`` marking steps past the end of the episode, which repeat the last
action. Keys and conventions follow LeRobot (images float32 CHW in [0, 1], ``<key>_is_pad`` True where
padded) so policies ported from LeRobot read our items unchanged.

The parquet columns are read into memory when the dataset is opened (they are small next to the videos),
and checked there: missing files, episode indices that disagree with the metadata, NaN/inf values and
dropped frames fail at once with the file and the episode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loongforge_embodied.data import lerobot_checks as checks
from loongforge_embodied.data.images import decode_image
from loongforge_embodied.data.lerobot_format import (
    INDEX_COLUMNS,
    V21,
    LeRobotFormatError,
    read_episodes,
    read_info,
    read_tasks,
)
from loongforge_embodied.data.stats import Stats, compute_stats, read_dataset_stats
from loongforge_embodied.data.video import ContainerCache, FrameLookupError, decode_frames

VIDEO_BACKENDS = ("pyav",)


class LeRobotDataset:
    """Frames of a LeRobotDataset on local disk.

    :param root: the dataset directory (holding ``meta/info.json``).
    :param action_horizon: shorthand for ``delta_timestamps={"action": [0, 1/fps, ..., (H-1)/fps]}``.
    :param delta_timestamps: feature -> time offsets in seconds (multiples of ``1/fps``) to stack around
        each frame; works for parquet features and video keys alike.
    :param episodes: read only these episode indices (e.g. a held-out split); items are their frames in order.
    :param video_backend: only ``"pyav"``.
    :param tolerance_s: how far a decoded frame's time may be from the asked time.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        action_horizon: int | None = None,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        episodes: Sequence[int] | None = None,
        video_backend: str = "pyav",
        tolerance_s: float = 1e-4,
    ) -> None:
        if video_backend not in VIDEO_BACKENDS:
            raise ValueError(f"video_backend '{video_backend}' is not supported; choose one of {VIDEO_BACKENDS}")
        self.root = Path(root)
        self.info = read_info(self.root)
        self.fps = self.info.fps
        self.episodes = read_episodes(self.root, self.info)
        self.tasks = read_tasks(self.root, self.info)
        checks.check_files_exist(self.root, self.info, self.episodes)
        self.columns, self._image_cells = self._load_columns()
        checks.check_episode_rows(self.root, self.episodes, self.columns["episode_index"], self.columns["index"])
        checks.check_finite(self.root, {k: self.columns[k] for k in self.info.data_keys}, self.episodes)
        checks.check_timestamps(self.root, self.columns["timestamp"], self.episodes, self.fps, tolerance_s)
        self.delta_timestamps = _resolve_deltas(action_horizon, delta_timestamps, self.fps)
        unknown = sorted(set(self.delta_timestamps) - set(self.columns) - set(self.camera_keys))
        if unknown:
            raise ValueError(f"delta_timestamps names unknown features {unknown}; features: {list(self.info.features)}")
        self._offsets = {key: _frame_offsets(key, deltas, self.fps) for key, deltas in self.delta_timestamps.items()}
        self._row_episode = np.repeat(np.arange(len(self.episodes)), [ep.length for ep in self.episodes])
        self._rows = self._selected_rows(episodes)
        self.tolerance_s = tolerance_s
        self._containers = ContainerCache()
        self._stats: Stats | None = None

    @property
    def video_keys(self) -> list[str]:
        return self.info.video_keys

    @property
    def camera_keys(self) -> list[str]:
        """Video keys, then cameras stored as images in the parquet files."""
        return self.info.camera_keys

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, position: int) -> dict[str, Any]:
        if not -len(self) <= position < len(self):
            raise IndexError(f"frame {position} out of range for {len(self)} frames")
        i = int(self._rows[position])
        ep = self.episodes[self._row_episode[i]]
        item: dict[str, Any] = {key: values[i] for key, values in self.columns.items()}
        for key, offsets in self._offsets.items():
            if key in self.columns:
                rows, is_pad = _window(i, offsets, ep.start, ep.length)
                item[key], item[f"{key}_is_pad"] = self.columns[key][rows], is_pad
        for key in self.camera_keys:
            rows, is_pad = _window(i, self._offsets.get(key, np.zeros(1, np.int64)), ep.start, ep.length)
            frames = self._decode(ep, key, rows).transpose(0, 3, 1, 2).astype(np.float32) / 255.0
            if key in self._offsets:
                item[key], item[f"{key}_is_pad"] = frames, is_pad
            else:
                item[key] = frames[0]
        item["task"] = self.tasks[int(self.columns["task_index"][i])]
        return item

    @property
    def stats(self) -> Stats:
        """The stats the dataset ships (v3.0 ``stats.json``; v2.1 per-episode stats merged)."""
        if self._stats is None:
            self._stats = read_dataset_stats(self.root, self.info)
        return self._stats

    def compute_stats(self, keys: Sequence[str] | None = None) -> Stats:
        """Exact stats (incl. quantiles) of parquet features over all frames; default: the float features."""
        if keys is None:
            keys = [k for k in self.info.data_keys if k not in INDEX_COLUMNS
                    and np.issubdtype(self.columns[k].dtype, np.floating)]
        return {key: compute_stats(self.columns[key]) for key in keys}

    def close(self) -> None:
        """Close the video files this thread opened."""
        self._containers.close()

    def _selected_rows(self, selected: Sequence[int] | None) -> np.ndarray:
        """Dataset rows of the ``selected`` episodes (all rows when ``None``)."""
        if selected is None:
            return np.arange(len(self._row_episode))
        by_index = {ep.index: ep for ep in self.episodes}
        unknown = sorted(set(selected) - set(by_index))
        if unknown:
            raise ValueError(f"episodes {unknown} are not in {self.root} (it has {len(self.episodes)} episodes: "
                             f"{self.episodes[0].index}..{self.episodes[-1].index})")
        eps = [by_index[e] for e in selected]
        return np.concatenate([np.arange(ep.start, ep.start + ep.length) for ep in eps]) if eps else np.zeros(0, int)

    def _decode(self, ep, key: str, rows: np.ndarray) -> np.ndarray:
        """The camera's frames at dataset rows ``rows`` (of episode ``ep``) as (K, H, W, 3) uint8."""
        if key in self._image_cells:
            try:
                return np.stack([decode_image(self._image_cells[key][int(r)].as_py()) for r in rows])
            except (ValueError, OSError) as err:
                raise LeRobotFormatError(f"{self.root / ep.data_path}: episode {ep.index} ({key}): {err}") from None
        span = ep.videos[key]
        timestamps = span.from_timestamp + self.columns["timestamp"][rows].astype(np.float64)
        try:
            return decode_frames(self._containers.get(self.root / span.path), timestamps, tolerance_s=self.tolerance_s)
        except FrameLookupError as err:
            raise LeRobotFormatError(f"{self.root / span.path}: episode {ep.index} ({key}): {err}") from None

    def _load_columns(self) -> tuple[dict[str, np.ndarray], dict[str, pa.ChunkedArray]]:
        """Every numeric parquet column as a numpy array over all frames, in episode order; image columns stay
        arrow arrays of encoded cells (decoded per item)."""
        parts, cells = [], []
        for ep in self.episodes if self.info.version == V21 else _first_per_file(self.episodes):
            path = self.root / ep.data_path
            table = pq.read_table(path)
            if self.info.version == V21 and table.num_rows != ep.length:
                raise LeRobotFormatError(
                    f"{path}: {table.num_rows} rows but meta/episodes.jsonl gives episode {ep.index} length {ep.length}"
                )
            missing = [c for c in (*INDEX_COLUMNS, *self.info.data_keys, *self.info.image_keys)
                       if c not in table.column_names]
            if missing:
                raise LeRobotFormatError(f"{path}: columns {missing} are missing (episode {ep.index})")
            numeric = [name for name in table.column_names if name not in self.info.image_keys]
            try:
                parts.append({name: _named_column(table, name) for name in numeric})
            except ValueError as err:
                raise LeRobotFormatError(f"{path}: {err} (episode {ep.index})") from None
            cells.append({key: table.column(key) for key in self.info.image_keys})
        columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        images = {key: pa.chunked_array([chunk for part in cells for chunk in part[key].chunks])
                  for key in self.info.image_keys}
        return columns, images


def column_to_numpy(chunked: pa.ChunkedArray) -> np.ndarray:
    """A parquet column as (N,) for scalars or (N, D) for fixed- or variable-size lists of equal length."""
    column = chunked.combine_chunks()
    if pa.types.is_list(column.type) and len(np.unique(column.value_lengths().to_numpy(zero_copy_only=False))) > 1:
        raise ValueError(f"a list column holds lists of different lengths ({column.type})")
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(column), -1)
    return column.to_numpy(zero_copy_only=False)


def _named_column(table: pa.Table, name: str) -> np.ndarray:
    try:
        return column_to_numpy(table.column(name))
    except ValueError as err:
        raise ValueError(f"column '{name}': {err}") from None


def _first_per_file(episodes):
    seen: dict[str, Any] = {}
    for ep in episodes:
        seen.setdefault(ep.data_path, ep)
    return list(seen.values())


def _resolve_deltas(horizon, deltas, fps) -> dict[str, list[float]]:
    resolved = {key: list(values) for key, values in (deltas or {}).items()}
    if horizon is not None:
        if "action" in resolved:
            raise ValueError("give either action_horizon or delta_timestamps['action'], not both")
        resolved["action"] = [k / fps for k in range(horizon)]
    return resolved


def _frame_offsets(key: str, deltas: Sequence[float], fps: int) -> np.ndarray:
    steps = np.asarray(deltas, dtype=np.float64) * fps
    offsets = np.round(steps).astype(np.int64)
    if np.abs(steps - offsets).max(initial=0.0) > 1e-4 * fps:
        raise ValueError(f"delta_timestamps['{key}'] = {list(deltas)} are not multiples of 1/fps = {1 / fps:.6f} s")
    return offsets


def _window(row: int, offsets: np.ndarray, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``row + offsets`` clamped to the episode (repeating its first/last frame) and where they were."""
    wanted = row + offsets
    rows = np.clip(wanted, start, start + length - 1)
    return rows, rows != wanted
