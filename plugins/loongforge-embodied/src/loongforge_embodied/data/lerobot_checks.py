"""Checks run when a LeRobotDataset is opened, so a broken dataset fails at once with a one-line message
naming the file and the episode, instead of hours into training (or never, as a silent NaN loss).

Each check raises :class:`~loongforge_embodied.data.lerobot_format.LeRobotFormatError` on the first problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from loongforge_embodied.data.lerobot_format import DatasetInfo, EpisodeEntry, LeRobotFormatError


def check_files_exist(root: Path, info: DatasetInfo, episodes: Sequence[EpisodeEntry]) -> None:
    """Every episode's data parquet and, per video key, its mp4 are present."""
    for ep in episodes:
        if not (root / ep.data_path).is_file():
            raise LeRobotFormatError(f"{root / ep.data_path}: data file of episode {ep.index} is missing")
        for key in info.video_keys:
            path = root / ep.videos[key].path
            if not path.is_file():
                raise LeRobotFormatError(f"{path}: video file of episode {ep.index} ({key}) is missing")


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
            ep = next(e for e in episodes if e.start <= row < e.start + e.length)
            raise LeRobotFormatError(
                f"{root / ep.data_path}: episode {ep.index}, frame {row - ep.start}: '{key}' is not finite "
                f"({np.array2string(values[row], precision=4)}); {len(bad_rows)} bad row(s) in '{key}'"
            )


def check_timestamps(
    root: Path, timestamps: np.ndarray, episodes: Sequence[EpisodeEntry], fps: int, tolerance_s: float
) -> None:
    """Within each episode consecutive timestamps are ``1/fps`` apart (a dropped or repeated frame would
    pair states with the wrong images and shift every action chunk after it)."""
    for ep in episodes:
        gaps = np.diff(timestamps[ep.start:ep.start + ep.length].astype(np.float64))
        bad = np.flatnonzero(np.abs(gaps - 1.0 / fps) > tolerance_s)
        if len(bad):
            frame = int(bad[0]) + 1
            raise LeRobotFormatError(
                f"{root / ep.data_path}: episode {ep.index}, frame {frame}: timestamp "
                f"{timestamps[ep.start + frame]:.4f} s is {gaps[bad[0]]:.4f} s after the previous frame, "
                f"not 1/fps = {1 / fps:.4f} s"
            )
