"""The on-disk layout of LeRobotDataset v2.1 and v3.0: file names, ``meta/info.json`` and the episode table.

Both versions keep low-dimensional data (states, actions, indices) in parquet and camera streams in mp4, and
describe themselves in ``meta/info.json``. They differ in how episodes map to files:

- **v2.1**: one parquet and one mp4 per episode (``data/chunk-000/episode_000007.parquet``,
  ``videos/chunk-000/<video_key>/episode_000007.mp4``); episodes, tasks and per-episode stats are JSON lines
  (``meta/episodes.jsonl``, ``meta/tasks.jsonl``, ``meta/episodes_stats.jsonl``).
- **v3.0**: many episodes per file (``data/chunk-000/file-000.parquet``,
  ``videos/<video_key>/chunk-000/file-000.mp4``); the episode table is parquet
  (``meta/episodes/chunk-000/file-000.parquet``) giving each episode's global row range
  (``dataset_from_index``/``dataset_to_index``), its data file, and per video key its file and time span
  (``videos/<key>/from_timestamp``); tasks are ``meta/tasks.parquet``; dataset stats ``meta/stats.json``.

This module turns either into one list of :class:`EpisodeEntry` so the reader does not care which it got.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

V21, V30 = "v2.1", "v3.0"
SUPPORTED_VERSIONS = (V21, V30)

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
# v3.0
TASKS_PARQUET = "meta/tasks.parquet"
EPISODES_PARQUET = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DATA_PATH_V30 = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH_V30 = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
# v2.1
EPISODES_JSONL = "meta/episodes.jsonl"
TASKS_JSONL = "meta/tasks.jsonl"
EPISODES_STATS_JSONL = "meta/episodes_stats.jsonl"
DATA_PATH_V21 = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH_V21 = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

#: Columns every LeRobot data parquet has besides the features a robot records.
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")


class LeRobotFormatError(ValueError):
    """A dataset on disk is not a readable LeRobotDataset; the message names the file and the episode."""


@dataclass(frozen=True)
class VideoSpan:
    """Where one episode's frames of one camera live: a file and the time of the episode's first frame."""

    path: str
    from_timestamp: float


@dataclass(frozen=True)
class EpisodeEntry:
    """One episode as the metadata describes it (paths relative to the dataset root)."""

    index: int
    length: int
    tasks: tuple[str, ...]
    data_path: str
    #: First global frame index (v3.0 ``dataset_from_index``; v2.1: the running sum of lengths).
    start: int
    videos: dict[str, VideoSpan] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetInfo:
    """The parts of ``meta/info.json`` the reader needs, plus the whole of it in ``raw``."""

    version: str
    fps: int
    features: dict[str, dict[str, Any]]
    chunks_size: int
    raw: dict[str, Any]

    @property
    def video_keys(self) -> list[str]:
        return [key for key, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        """Cameras stored as encoded images inside the parquet files."""
        return [key for key, ft in self.features.items() if ft["dtype"] == "image"]

    @property
    def camera_keys(self) -> list[str]:
        return self.video_keys + self.image_keys

    @property
    def data_keys(self) -> list[str]:
        """Numeric features stored in the parquet files (everything but cameras)."""
        return [key for key, ft in self.features.items() if ft["dtype"] not in ("video", "image")]


def read_info(root: Path) -> DatasetInfo:
    """Parse and check ``meta/info.json``; an unsupported ``codebase_version`` is an error."""
    path = root / INFO_PATH
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing; is {root} a LeRobotDataset root (meta/, data/, videos/)?")
    raw = json.loads(path.read_text())
    version = raw.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise LeRobotFormatError(
            f"{path}: codebase_version {version!r} is not supported; readable: {', '.join(SUPPORTED_VERSIONS)} "
            "(upgrade older datasets with LeRobot's conversion scripts, v2.0 -> v2.1 -> v3.0)"
        )
    return DatasetInfo(version, int(raw["fps"]), raw["features"], int(raw.get("chunks_size", 1000)), raw)


def read_episodes(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    """The episode table of either version, in episode order."""
    entries = _episodes_v21(root, info) if info.version == V21 else _episodes_v30(root, info)
    return sorted(entries, key=lambda e: e.index)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_tasks(root: Path, info: DatasetInfo) -> dict[int, str]:
    """``task_index -> task text``. v3.0 keeps the text as the pandas index of ``tasks.parquet``; written by
    pandas it is a column named ``task`` (or ``__index_level_0__`` when the index had no name)."""
    if info.version == V21:
        return {int(row["task_index"]): row["task"] for row in read_jsonl(root / TASKS_JSONL)}
    path = root / TASKS_PARQUET
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing")
    table = pq.read_table(path)
    text_column = next((c for c in ("task", "__index_level_0__") if c in table.column_names), None)
    if text_column is None:
        raise LeRobotFormatError(f"{path}: no task text column (expected 'task'); columns: {table.column_names}")
    return dict(zip(table.column("task_index").to_pylist(), table.column(text_column).to_pylist(), strict=True))


def _episodes_v21(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    data_path = info.raw.get("data_path", DATA_PATH_V21)
    video_path = info.raw.get("video_path") or VIDEO_PATH_V21
    entries, start = [], 0
    for row in sorted(read_jsonl(root / EPISODES_JSONL), key=lambda r: r["episode_index"]):
        index = int(row["episode_index"])
        chunk = index // info.chunks_size
        videos = {
            key: VideoSpan(video_path.format(episode_chunk=chunk, video_key=key, episode_index=index), 0.0)
            for key in info.video_keys
        }
        entries.append(EpisodeEntry(
            index, int(row["length"]), tuple(row.get("tasks", ())),
            data_path.format(episode_chunk=chunk, episode_index=index), start, videos,
        ))
        start += int(row["length"])
    return entries


def _episodes_v30(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    data_path = info.raw.get("data_path", DATA_PATH_V30)
    video_path = info.raw.get("video_path") or VIDEO_PATH_V30
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise LeRobotFormatError(f"{root / 'meta' / 'episodes'}: no episode table (chunk-*/file-*.parquet)")
    entries = []
    for file in files:
        table = pq.read_table(file, columns=[c for c in pq.read_schema(file).names if not c.startswith("stats/")])
        for row in table.to_pylist():
            videos = {
                key: VideoSpan(
                    video_path.format(
                        video_key=key,
                        chunk_index=row[f"videos/{key}/chunk_index"],
                        file_index=row[f"videos/{key}/file_index"],
                    ),
                    float(row[f"videos/{key}/from_timestamp"]),
                )
                for key in info.video_keys
            }
            length = int(row["dataset_to_index"]) - int(row["dataset_from_index"])
            if "length" in row and int(row["length"]) != length:
                raise LeRobotFormatError(
                    f"{file}: episode {row['episode_index']}: length {row['length']} disagrees with "
                    f"dataset_to_index - dataset_from_index = {length}"
                )
            entries.append(EpisodeEntry(
                int(row["episode_index"]), length, tuple(row.get("tasks") or ()),
                data_path.format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]),
                int(row["dataset_from_index"]), videos,
            ))
    return entries
