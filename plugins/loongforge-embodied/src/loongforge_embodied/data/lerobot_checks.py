"""Checks run when a LeRobotDataset is opened, so a broken dataset fails at once with a one-line message
naming the file and the episode, instead of hours into training (or never, as a silent NaN loss).

Each check raises :class:`~loongforge_embodied.data.lerobot_format.LeRobotFormatError` on the first problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from loongforge_embodied.data.lerobot_format import (
    INFO_PATH,
    DatasetInfo,
    EpisodeEntry,
    LeRobotFormatError,
    numeric_dtype,
)


def check_episode_table(root: Path, info: DatasetInfo, episodes: Sequence[EpisodeEntry]) -> None:
    """The metadata lists at least one episode, each index once and within ``total_episodes`` of info.json (when
    it says), each with at least one frame. (Lengths are checked against the data rows by
    :func:`check_episode_rows`, which can name the file.)"""
    if not episodes:
        raise LeRobotFormatError(f"{root}: the dataset has no episodes (the episode metadata lists none)")
    total = _declared(root, info, "total_episodes")
    seen: set[int] = set()
    for ep in episodes:
        where = root / ep.meta_path
        if ep.index in seen:
            raise LeRobotFormatError(f"{where}: episode {ep.index} is listed twice")
        seen.add(ep.index)
        if ep.index < 0 or (total is not None and ep.index >= total):
            bound = f"0..{total - 1} ({INFO_PATH} says total_episodes {total})" if total is not None else ">= 0"
            raise LeRobotFormatError(f"{where}: episode index {ep.index} is out of range; indices are {bound}")
        if ep.length < 1:
            raise LeRobotFormatError(f"{where}: episode {ep.index} has length {ep.length}; every episode needs a frame")
    if total is not None and len(episodes) != total:
        raise LeRobotFormatError(f"{root / INFO_PATH}: total_episodes is {total} but the episode metadata lists "
                                 f"{len(episodes)}")


def _declared(root: Path, info: DatasetInfo, key: str) -> int | None:
    """An optional count of info.json (``total_episodes``), checked to be a whole number."""
    value = info.raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LeRobotFormatError(f"{root / INFO_PATH}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def check_columns(path: Path, ep: EpisodeEntry, columns: Mapping[str, np.ndarray], info: DatasetInfo) -> None:
    """Each numeric feature's column (of the data file ``path``, whose first episode is ``ep``) holds numbers of the
    kind info.json declares (integers for an integer dtype) and as many per frame as its ``shape`` says."""
    for key in info.data_keys:
        declared = numeric_dtype(info.features[key]["dtype"])
        values = columns[key]
        if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise LeRobotFormatError(f"{path}: column '{key}' holds {values.dtype} values, but {INFO_PATH} declares "
                                     f"{declared} (episode {ep.index})")
        if not np.issubdtype(declared, np.floating) and np.issubdtype(values.dtype, np.floating):
            raise LeRobotFormatError(f"{path}: column '{key}' holds floats, but {INFO_PATH} declares {declared} "
                                     f"(episode {ep.index})")
        per_frame = int(np.prod(values.shape[1:], dtype=np.int64))
        expected = int(np.prod(info.features[key]["shape"], dtype=np.int64))
        if per_frame != expected:
            raise LeRobotFormatError(f"{path}: column '{key}' has {per_frame} value(s) per frame, but {INFO_PATH} "
                                     f"gives shape {info.features[key]['shape']} (episode {ep.index})")


def _frame_at(root: Path, episodes: Sequence[EpisodeEntry], row: int) -> str:
    """Where global frame ``row`` is, as an error names it: ``FILE: episode N, frame F``."""
    ep = next(e for e in episodes if e.start <= row < e.start + e.length)
    return f"{root / ep.data_path}: episode {ep.index}, frame {row - ep.start}"


def check_task_indices(root: Path, episodes: Sequence[EpisodeEntry], task_index: np.ndarray,
                       tasks: Mapping[int, str], tasks_file: str, column: str = "task_index") -> None:
    """Every frame's ``column`` (``task_index``, or LeRobot 0.4's ``subtask_index``) names a row of the text table
    ``tasks_file``."""
    unknown = np.flatnonzero(~np.isin(task_index, np.fromiter(tasks, dtype=np.int64, count=len(tasks))))
    if len(unknown):
        row = int(unknown[0])
        raise LeRobotFormatError(
            f"{_frame_at(root, episodes, row)}: {column} {task_index[row]} is not in {root / tasks_file} "
            f"(indices {sorted(tasks)})"
        )


def check_files_exist(root: Path, info: DatasetInfo, episodes: Sequence[EpisodeEntry]) -> None:
    """Every episode's data parquet and, per video key, its mp4 are present."""
    for ep in episodes:
        if not (root / ep.data_path).is_file():
            raise LeRobotFormatError(f"{root / ep.data_path}: data file of episode {ep.index} is missing")
        for key in info.video_keys:
            path = root / ep.videos[key].path
            if not path.is_file():
                raise LeRobotFormatError(f"{path}: video file of episode {ep.index} ({key}) is missing")


def check_file_rows(root: Path, path: Path, group: Sequence[EpisodeEntry], rows: int) -> None:
    """A data file holds as many rows as the metadata's lengths of the episodes it holds (``group``) sum to."""
    lengths = [ep.length for ep in group]
    if rows == sum(lengths):
        return
    listed = (f"episode {group[0].index} length {lengths[0]}" if len(group) == 1 else
              f"episodes {[ep.index for ep in group]} lengths {' + '.join(map(str, lengths))} = {sum(lengths)}")
    raise LeRobotFormatError(f"{path}: {rows} rows but {root / group[0].meta_path} gives {listed}")


def check_episode_rows(
    root: Path, episodes: Sequence[EpisodeEntry], episode_column: np.ndarray, index_column: np.ndarray
) -> None:
    """The parquet rows where the metadata puts each episode carry that episode's index, and the global
    ``index`` column counts 0, 1, 2, ... across the files (rows are addressed by it)."""
    expected = sum(ep.length for ep in episodes)
    if expected != len(index_column):
        raise LeRobotFormatError(
            f"{root / 'data'}: the data files hold {len(index_column)} rows but the episode metadata sums to "
            f"{expected} frames"
        )
    for ep in episodes:
        rows, last = slice(ep.start, ep.start + ep.length), ep.start + ep.length - 1
        found = np.unique(episode_column[rows])
        if found.tolist() != [ep.index]:
            raise LeRobotFormatError(
                f"{root / ep.data_path}: rows for episode {ep.index} (global index {ep.start}..{last}) "
                f"have episode_index {found.tolist()}; the parquet disagrees with the episode metadata"
            )
        if not np.array_equal(index_column[rows], np.arange(ep.start, last + 1)):
            raise LeRobotFormatError(
                f"{root / ep.data_path}: episode {ep.index}: the 'index' column is not {ep.start}..{last}"
            )


def check_finite(root: Path, columns: Mapping[str, np.ndarray], episodes: Sequence[EpisodeEntry]) -> None:
    """No NaN or infinity in any floating-point feature (states, actions, ...)."""
    for key, values in columns.items():
        if not np.issubdtype(values.dtype, np.floating):
            continue
        bad_rows = np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))
        if len(bad_rows):
            row = int(bad_rows[0])
            raise LeRobotFormatError(
                f"{_frame_at(root, episodes, row)}: '{key}' is not finite "
                f"({np.array2string(values[row], precision=4)}); {len(bad_rows)} bad row(s) in '{key}'"
            )


def check_timestamps(
    root: Path, timestamps: np.ndarray, episodes: Sequence[EpisodeEntry], fps: int, tolerance_s: float
) -> None:
    """Within each episode consecutive timestamps are ``1/fps`` apart (a dropped or repeated frame would
    pair states with the wrong images and shift every action chunk after it)."""
    for ep in episodes:
        gaps = np.diff(timestamps[ep.start:ep.start + ep.length].astype(np.float64))
        bad = np.flatnonzero(~(np.abs(gaps - 1.0 / fps) <= tolerance_s))  # NaN gaps are bad too
        if len(bad):
            frame = int(bad[0]) + 1
            raise LeRobotFormatError(
                f"{root / ep.data_path}: episode {ep.index}, frame {frame}: timestamp "
                f"{timestamps[ep.start + frame]:.4f} s is {gaps[bad[0]]:.4f} s after the previous frame, "
                f"not 1/fps = {1 / fps:.4f} s"
            )
