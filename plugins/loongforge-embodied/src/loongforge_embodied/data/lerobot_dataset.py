"""A map-style reader of LeRobotDataset v2.1 and v3.0 directories: item ``i`` is frame ``i`` of the dataset.

An item has what a VLA policy trains on: the frame's low-dimensional features (``observation.state``, ...),
its camera images (decoded from mp4 at the frame's timestamp, or from PNG cells of the parquet), the task
text, and windows of future (or past) values asked for by ``delta_timestamps`` -- typically an action chunk
``action[t : t + H]`` with ``action_is_pad`` marking steps past the end of the episode, which repeat the last
action. Keys and conventions follow LeRobot (images float32 CHW in [0, 1], ``<key>_is_pad`` True where
padded) so policies ported from LeRobot read our items unchanged.

The parquet columns are read into memory when the dataset is opened (they are small next to the videos),
and checked there, as are the metadata and the shipped stats: unreadable or missing files, missing keys and
columns, columns of the wrong type or width, episode indices out of range or disagreeing with the data, task
indices without a task, NaN/inf values and dropped frames fail at once with one
:class:`~loongforge_embodied.data.lerobot_format.LeRobotFormatError` naming the file and the episode. Videos are
opened when first read; :meth:`LeRobotDataset.check_videos` opens them up front (all, or a spread sample of a large
set), as ``loongforge check`` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loongforge_embodied.data import lerobot_checks as checks
from loongforge_embodied.data.images import decode_image
from loongforge_embodied.data.lerobot_format import (
    INDEX_COLUMNS,
    INFO_PATH,
    TASKS_JSONL,
    TASKS_PARQUET,
    V21,
    EpisodeEntry,
    LeRobotFormatError,
    one_line,
    read_episodes,
    read_info,
    read_parquet,
    read_tasks,
    read_text_table,
)
from loongforge_embodied.data.lerobot_language import (
    LANGUAGE_PERSISTENT,
    SUBTASK_INDEX,
    SUBTASKS_PARQUET,
    active_texts,
)
from loongforge_embodied.data.stats import Stats, compute_stats, read_dataset_stats, stats_file
from loongforge_embodied.data.video import ContainerCache, FrameLookupError, VideoFileError, decode_frames

VIDEO_BACKENDS = ("pyav",)
#: Video files :meth:`LeRobotDataset.check_videos` opens at most (an evenly spread sample beyond that).
VIDEO_PROBES = 256


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
        checks.check_episode_table(self.root, self.info, self.episodes)
        self.tasks = read_tasks(self.root, self.info)
        checks.check_files_exist(self.root, self.info, self.episodes)
        self.columns, self._cells = self._load_columns()
        checks.check_episode_rows(self.root, self.episodes, self.columns["episode_index"], self.columns["index"])
        checks.check_task_indices(self.root, self.episodes, self.columns["task_index"], self.tasks,
                                  TASKS_JSONL if self.info.version == V21 else TASKS_PARQUET)
        self.subtasks = self._subtasks()
        checks.check_finite(self.root, {k: self.columns[k] for k in self.info.data_keys}, self.episodes)
        checks.check_timestamps(self.root, self.columns["timestamp"], self.episodes, self.fps, tolerance_s)
        # the shipped stats, when there are any: a corrupt file fails here, not when a normaliser first asks
        self._stats: Stats | None = (read_dataset_stats(self.root, self.info)
                                     if stats_file(self.root, self.info).is_file() else None)
        self.delta_timestamps = _resolve_deltas(action_horizon, delta_timestamps, self.fps)
        depth = sorted(set(self.delta_timestamps) & set(self.info.depth_keys))
        if depth:
            raise ValueError(f"delta_timestamps names {depth[0]!r}, a depth map ({INFO_PATH} marks it is_depth_map): "
                             "LoongForge reads RGB cameras only; leave depth features out")
        unknown = sorted(set(self.delta_timestamps) - set(self.columns) - set(self.camera_keys))
        if unknown:
            raise ValueError(f"delta_timestamps names unknown features {unknown}; features: {list(self.info.features)}")
        self._offsets = {key: _frame_offsets(key, deltas, self.fps) for key, deltas in self.delta_timestamps.items()}
        self._row_episode = np.repeat(np.arange(len(self.episodes)), [ep.length for ep in self.episodes])
        self._rows = self._selected_rows(episodes)
        self.tolerance_s = tolerance_s
        self._containers = ContainerCache()

    @property
    def video_keys(self) -> list[str]:
        return self.info.video_keys

    @property
    def camera_keys(self) -> list[str]:
        """The RGB cameras: video keys, then cameras stored as images in the parquet files (depth maps are not
        cameras: :attr:`DatasetInfo.depth_keys`)."""
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
        item.update({key: cells[i].as_py() for key, cells in self._cells.items() if key not in self.info.image_keys})
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
        self._add_language(item, i, ep)
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

    def check_videos(self, max_files: int = VIDEO_PROBES) -> tuple[int, int]:
        """Open video files the episodes name and decode the first frame each holds, so a corrupt or truncated
        file fails now, naming it and an episode it holds, rather than when its frames are first read. All of them
        up to ``max_files``; beyond that an evenly spread sample of ``max_files`` (first and last included: a v2.1
        set has one file per episode and camera, and opening each costs milliseconds) -- a file left out still
        fails, in one line, when it is read. Returns (files opened, files named)."""
        files: dict[tuple[str, str], EpisodeEntry] = {}
        for key in self.video_keys:
            for ep in self.episodes:
                files.setdefault((key, ep.videos[key].path), ep)
        named = list(files.items())
        picks = np.unique(np.linspace(0, len(named) - 1, min(len(named), max_files)).round().astype(int))
        for (key, path), ep in (named[i] for i in picks):
            with self._video_errors(path, ep, key):
                decode_frames(self._containers.get(self.root / path), [ep.videos[key].from_timestamp],
                              tolerance_s=self.tolerance_s)
        return len(picks), len(named)

    def describe(self) -> str:
        """One line: version, episodes, frames, fps and cameras."""
        frames = sum(ep.length for ep in self.episodes)
        depth = f", depth maps {self.info.depth_keys} (not read)" if self.info.depth_keys else ""
        return (f"{self.root}: LeRobot {self.info.version}, {self.num_episodes} episodes, {frames} frames at "
                f"{self.fps} fps, cameras {self.camera_keys}{depth}")

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
        if key in self._cells:
            try:
                return np.stack([decode_image(self._cells[key][int(r)].as_py()) for r in rows])
            except (ValueError, OSError) as err:
                raise LeRobotFormatError(f"{self.root / ep.data_path}: episode {ep.index} ({key}): {err}") from None
        span = ep.videos[key]
        timestamps = span.from_timestamp + self.columns["timestamp"][rows].astype(np.float64)
        with self._video_errors(span.path, ep, key):
            return decode_frames(self._containers.get(self.root / span.path), timestamps, tolerance_s=self.tolerance_s)

    @contextmanager
    def _video_errors(self, path: str, ep: EpisodeEntry, key: str) -> Iterator[None]:
        """A video that does not open or decode, or lacks a wanted frame, as a format error naming the file."""
        try:
            yield
        except (FrameLookupError, VideoFileError) as err:
            raise LeRobotFormatError(f"{self.root / path}: episode {ep.index} ({key}): {err}") from None

    def _subtasks(self) -> dict[int, str] | None:
        """LeRobot 0.4's subtask texts (``meta/subtasks.parquet``) when the data has a ``subtask_index`` column."""
        if SUBTASK_INDEX not in self.columns or not (self.root / SUBTASKS_PARQUET).is_file():
            return None
        subtasks = read_text_table(self.root / SUBTASKS_PARQUET, SUBTASK_INDEX, "subtask")
        checks.check_task_indices(self.root, self.episodes, self.columns[SUBTASK_INDEX], subtasks, SUBTASKS_PARQUET,
                                  SUBTASK_INDEX)
        return subtasks

    def _add_language(self, item: dict[str, Any], row: int, ep: EpisodeEntry) -> None:
        """The frame's subtask (and plan, memory) as text: from LeRobot 0.6's ``language_persistent`` rows active at
        the frame's time, or LeRobot 0.4's ``subtask_index``."""
        if self.subtasks is not None:
            item["subtask"] = self.subtasks[int(self.columns[SUBTASK_INDEX][row])]
        if LANGUAGE_PERSISTENT in item:
            try:
                item.update(active_texts(item[LANGUAGE_PERSISTENT] or [], float(self.columns["timestamp"][row])))
            except (ValueError, KeyError, TypeError) as err:
                raise LeRobotFormatError(f"{self.root / ep.data_path}: episode {ep.index}, frame "
                                         f"{row - ep.start}: {LANGUAGE_PERSISTENT}: {one_line(err)}") from None

    def _load_columns(self) -> tuple[dict[str, np.ndarray], dict[str, pa.ChunkedArray]]:
        """Every numeric parquet column as a numpy array over all frames, in episode order; the other columns
        (encoded images, strings, LeRobot 0.6's language rows, kinds a later LeRobot adds) stay arrow arrays of
        cells, turned into Python values per item."""
        parts, cells = [], []
        for group in _by_data_file(self.episodes):
            ep, path = group[0], self.root / group[0].data_path
            table = read_parquet(path, episode=ep.index)
            checks.check_file_rows(self.root, path, group, table.num_rows)
            missing = [c for c in (*INDEX_COLUMNS, *self.info.data_keys, *self.info.image_keys,
                                   *self.info.passthrough_keys) if c not in table.column_names]
            if missing:
                raise LeRobotFormatError(f"{path}: columns {missing} are missing (episode {ep.index})")
            as_cells = [name for name in table.column_names if name not in self.info.data_keys
                        and (name in self.info.features or not _numeric_arrow(table.schema.field(name).type))]
            try:
                part = {name: _named_column(table, name) for name in table.column_names if name not in as_cells}
            except (ValueError, pa.ArrowException) as err:
                raise LeRobotFormatError(f"{path}: {err} (episode {ep.index})") from None
            checks.check_columns(path, ep, part, self.info)
            parts.append(part)
            cells.append({name: table.column(name) for name in as_cells})
        columns = {}
        for name in [n for n in parts[0] if all(n in part for part in parts)]:
            try:
                columns[name] = np.concatenate([part[name] for part in parts])
            except ValueError:
                raise LeRobotFormatError(f"{self.root / 'data'}: column '{name}' has different widths in different "
                                         "data files") from None
        shared = [name for name in cells[0] if all(name in part for part in cells)]
        return columns, {name: pa.chunked_array([chunk for part in cells for chunk in part[name].chunks])
                         for name in shared}


def _numeric_arrow(kind: pa.DataType) -> bool:
    """Whether a column of arrow type ``kind`` holds numbers: a number or bool, or (fixed-size) lists of them."""
    while pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


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
    except (ValueError, pa.ArrowException) as err:
        raise ValueError(f"column '{name}': {' '.join(str(err).split())}") from None


def _by_data_file(episodes: Sequence[EpisodeEntry]) -> list[list[EpisodeEntry]]:
    """The episodes grouped by data file (one each in v2.1, several in v3.0), files in order of their first."""
    files: dict[str, list[EpisodeEntry]] = {}
    for ep in episodes:
        files.setdefault(ep.data_path, []).append(ep)
    return list(files.values())


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
