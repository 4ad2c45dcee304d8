"""Write in-memory episodes as a LeRobotDataset (v2.1 or v3.0), so tests and demos need no downloads.

Produces what LeRobot itself writes: ``meta/info.json``, the episode/task/stats metadata of the chosen
version, parquet data with the index columns (one row group per episode), and per camera either H.264/AV1 mp4
videos (one per episode in v2.1, one per group of ``episodes_per_file`` episodes in v3.0, the episodes
concatenated in time) or PNG images inside the parquet (``VideoOptions(codec="png")``).

``lerobot`` picks whose writer to follow. LeRobot 0.4 and 0.6 both write ``codebase_version`` v3.0; 0.6 (v3.0 only)
records each video's encoder settings (``video.g``, ``video.crf``, ...) and ``is_depth_map`` in place of 0.4's
``video.is_depth_map``, and keeps subtask annotations in its ``language_persistent`` / ``language_events`` columns
where 0.4 had a ``subtask_index`` column and ``meta/subtasks.parquet``. Without subtasks a 0.6-style set is read by
LeRobot 0.4.4 too; with them it needs LeRobot >= 0.6 (0.4.4's reader has no feature dtype ``language``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loongforge.errors import ConfigError

from loongforge_embodied.data import lerobot_format as fmt
from loongforge_embodied.data.images import image_column
from loongforge_embodied.data.lerobot_language import (
    LANGUAGE_FEATURES,
    SUBTASK_INDEX,
    SUBTASKS_PARQUET,
    language_columns,
    subtask_at,
)
from loongforge_embodied.data.stats import Stats, aggregate_stats, compute_stats, stats_to_json
from loongforge_embodied.data.video import encode_video

#: The LeRobot releases whose dataset writer :func:`write_lerobot_dataset` can follow.
LEROBOT_04, LEROBOT_06 = "0.4", "0.6"
LEROBOT_RELEASES = (LEROBOT_04, LEROBOT_06)
#: The key order of LeRobot 0.6's info.json (its ``DatasetInfo`` dataclass).
_INFO_ORDER_06 = ("codebase_version", "fps", "features", "total_episodes", "total_frames", "total_tasks",
                  "chunks_size", "data_files_size_in_mb", "video_files_size_in_mb", "data_path", "video_path",
                  "robot_type", "splits")


@dataclass
class EpisodeData:
    """One recorded episode: per-frame numeric features, camera frames and the task text."""

    task: str
    #: feature name -> (T, D) array, e.g. ``{"observation.state": ..., "action": ...}``.
    features: dict[str, np.ndarray]
    #: video key -> (T, H, W, 3) uint8 RGB, e.g. ``{"observation.images.top": ...}``.
    cameras: dict[str, np.ndarray] = field(default_factory=dict)
    #: ``(start time in seconds, text)`` of each subtask in order, the first at 0 (optional annotations).
    subtasks: list[tuple[float, str]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(next(iter(self.features.values())))


@dataclass(frozen=True)
class VideoOptions:
    """How cameras are stored: ``codec`` "h264" or "av1" mp4 videos (``crf``, key frame every ``gop``
    frames), or "png" for lossless images inside the parquet files (LeRobot feature dtype ``image``)."""

    codec: str = "h264"
    crf: int = 10
    gop: int = 2

    @property
    def as_images(self) -> bool:
        return self.codec == "png"


def write_lerobot_dataset(
    root: str | Path,
    episodes: Sequence[EpisodeData],
    *,
    fps: int,
    version: str = fmt.V30,
    video: VideoOptions = VideoOptions(),
    episodes_per_file: int = 1000,
    chunks_size: int = 1000,
    robot_type: str | None = None,
    lerobot: str = LEROBOT_04,
) -> Path:
    """Write ``episodes`` under ``root`` in LeRobot format ``version`` as LeRobot release ``lerobot`` writes it;
    returns ``root``."""
    if version not in fmt.SUPPORTED_VERSIONS:
        raise ValueError(f"version must be one of {fmt.SUPPORTED_VERSIONS}, got {version!r}")
    if lerobot not in LEROBOT_RELEASES:
        raise ConfigError(f"the LeRobot release to write as must be one of {LEROBOT_RELEASES}, got {lerobot!r}")
    if lerobot == LEROBOT_06 and version != fmt.V30:
        raise ConfigError(f"LeRobot 0.6 reads and writes LeRobotDataset {fmt.V30} only, not {version}")
    root = Path(root)
    tasks = list(dict.fromkeys(ep.task for ep in episodes))
    subtasks = list(dict.fromkeys(text for ep in episodes for _, text in ep.subtasks))
    tables = [_episode_table(ep, i, sum(e.length for e in episodes[:i]), tasks.index(ep.task), fps, video,
                             _subtask_columns(ep, fps, subtasks, lerobot) if subtasks else {})
              for i, ep in enumerate(episodes)]
    stats = [_episode_stats(ep) for ep in episodes]
    if version == fmt.V21:
        _write_v21(root, episodes, tables, stats, tasks, fps, video, chunks_size)
    else:
        _write_v30(root, episodes, tables, stats, tasks, fps, video, episodes_per_file, chunks_size)
    if subtasks and lerobot == LEROBOT_04:
        _write_text_table(root / SUBTASKS_PARQUET, SUBTASK_INDEX, "subtask", subtasks)
    info = _info(episodes, version, fps, video, len(tasks), chunks_size, robot_type)
    if subtasks:
        info["features"].update(LANGUAGE_FEATURES if lerobot == LEROBOT_06 else
                                {SUBTASK_INDEX: {"dtype": "int64", "shape": [1], "names": None}})
    if lerobot == LEROBOT_06:
        info = _as_lerobot_06(info, video)
    _write_json(root / fmt.INFO_PATH, info)
    return root


def _subtask_columns(ep: EpisodeData, fps: int, subtasks: list[str], lerobot: str) -> dict[str, pa.Array]:
    """The episode's subtask annotations as LeRobot ``lerobot`` stores them: 0.6's language columns, or 0.4's
    ``subtask_index`` (each frame's subtask in ``meta/subtasks.parquet``)."""
    if lerobot == LEROBOT_06:
        return language_columns(ep.subtasks, ep.length)
    try:
        texts = [subtask_at(ep.subtasks, t / fps) for t in range(ep.length)]
    except (ValueError, IndexError) as err:
        raise ValueError(f"episode with task {ep.task!r}: LeRobot 0.4's subtask_index needs a subtask on every "
                         f"frame ({err or 'it has none'})") from None
    return {SUBTASK_INDEX: pa.array([subtasks.index(text) for text in texts], pa.int64())}


def _as_lerobot_06(info: dict, video: VideoOptions) -> dict:
    """``info`` as LeRobot 0.6 writes it: its key order, and per video the encoder settings it records and
    ``is_depth_map`` (0.4's ``video.is_depth_map``)."""
    for feature in info["features"].values():
        if feature["dtype"] != "video":
            continue
        stream = {k: v for k, v in feature["info"].items() if k != "video.is_depth_map"}
        feature["info"] = {**stream, "video.g": video.gop, "video.crf": video.crf, "video.preset": None,
                           "video.fast_decode": 0, "video.video_backend": "pyav", "video.extra_options": {},
                           "is_depth_map": False}
    return {key: info[key] for key in _INFO_ORDER_06 if key in info}


def write_once(root: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` a dataset into a private directory beside ``root``, then rename it into place: safe when
    several ranks race to write the same derived set (the losers drop theirs); returns ``root``."""
    root = Path(root)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    write(tmp)
    try:
        os.rename(tmp, root)
    except OSError:
        if not (root / fmt.INFO_PATH).is_file():
            raise
        shutil.rmtree(tmp)
    return root


def _episode_table(
    ep: EpisodeData, episode_index: int, start: int, task_index: int, fps: int, video: VideoOptions,
    annotations: dict[str, pa.Array],
) -> pa.Table:
    n = ep.length
    columns = {key: _feature_column(values) for key, values in ep.features.items()}
    if video.as_images:
        columns.update({key: image_column(frames) for key, frames in ep.cameras.items()})
    columns.update({
        "timestamp": pa.array(np.arange(n, dtype=np.float32) / fps),
        "frame_index": pa.array(np.arange(n, dtype=np.int64)),
        "episode_index": pa.array(np.full(n, episode_index, dtype=np.int64)),
        "index": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "task_index": pa.array(np.full(n, task_index, dtype=np.int64)),
        **annotations,
    })
    return pa.table(columns)


def _feature_column(values: np.ndarray) -> pa.Array:
    """(T,) -> a scalar column (LeRobot shape [1]); (T, ...) -> a fixed-size list column, row-major."""
    values = np.asarray(values)
    if values.ndim == 1:
        return pa.array(values)
    flat = values.reshape(len(values), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def _episode_stats(ep: EpisodeData) -> Stats:
    stats = {key: compute_stats(np.asarray(v).reshape(len(v), -1)) for key, v in ep.features.items()}
    for key, frames in ep.cameras.items():
        pixel = compute_stats(frames.reshape(-1, 3) / 255.0)
        stats[key] = {name: v.reshape(3, 1, 1) for name, v in pixel.items() if name != "count"}
        stats[key]["count"] = np.array([len(frames)])
    return stats


def _write_v21(root, episodes, tables, stats, tasks, fps, video, chunks_size) -> None:
    meta_rows, stats_rows = [], []
    for i, (ep, table) in enumerate(zip(episodes, tables, strict=True)):
        chunk = i // chunks_size
        _write_parquet(root / fmt.DATA_PATH_V21.format(episode_chunk=chunk, episode_index=i), table)
        for key, frames in _videos(ep, video).items():
            path = root / fmt.VIDEO_PATH_V21.format(episode_chunk=chunk, video_key=key, episode_index=i)
            encode_video(path, frames, fps, codec=video.codec, crf=video.crf, gop=video.gop)
        meta_rows.append({"episode_index": i, "tasks": [ep.task], "length": ep.length})
        stats_rows.append({"episode_index": i, "stats": stats_to_json(stats[i])})
    _write_jsonl(root / fmt.EPISODES_JSONL, meta_rows)
    _write_jsonl(root / fmt.TASKS_JSONL, [{"task_index": i, "task": t} for i, t in enumerate(tasks)])
    _write_jsonl(root / fmt.EPISODES_STATS_JSONL, stats_rows)


def _write_v30(root, episodes, tables, stats, tasks, fps, video, episodes_per_file, chunks_size) -> None:
    rows = []
    for first in range(0, len(episodes), episodes_per_file):
        group = range(first, min(first + episodes_per_file, len(episodes)))
        chunk_index, file_index = divmod(first // episodes_per_file, chunks_size)
        where = {"chunk_index": chunk_index, "file_index": file_index}
        _write_parquet(root / fmt.DATA_PATH_V30.format(**where), pa.concat_tables([tables[i] for i in group]))
        for key in _videos(episodes[first], video):
            frames = np.concatenate([episodes[i].cameras[key] for i in group])
            path = root / fmt.VIDEO_PATH_V30.format(video_key=key, **where)
            encode_video(path, frames, fps, codec=video.codec, crf=video.crf, gop=video.gop)
        offset = 0
        for i in group:
            ep, start = episodes[i], tables[i].column("index")[0].as_py()
            row = {
                "episode_index": i, "tasks": [ep.task], "length": ep.length,
                "data/chunk_index": chunk_index, "data/file_index": file_index,
                "dataset_from_index": start, "dataset_to_index": start + ep.length,
            }
            for key in _videos(ep, video):
                row.update({
                    f"videos/{key}/chunk_index": chunk_index, f"videos/{key}/file_index": file_index,
                    f"videos/{key}/from_timestamp": offset / fps,
                    f"videos/{key}/to_timestamp": (offset + ep.length) / fps,
                })
            row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
            row.update({f"stats/{key}/{name}": np.asarray(v).tolist()
                        for key, s in stats[i].items() for name, v in s.items()})
            rows.append(row)
            offset += ep.length
    _write_parquet(root / fmt.EPISODES_PARQUET.format(chunk_index=0, file_index=0), pa.Table.from_pylist(rows))
    _write_text_table(root / fmt.TASKS_PARQUET, "task_index", "task", tasks)
    merged = {key: aggregate_stats(s[key] for s in stats) for key in stats[0]}
    for key in merged:  # exact quantiles over all frames (merging per-episode quantiles only approximates)
        if key in episodes[0].features:
            merged[key] = compute_stats(np.concatenate([np.asarray(ep.features[key]) for ep in episodes]))
    _write_json(root / fmt.STATS_PATH, stats_to_json(merged))


def _videos(ep: EpisodeData, video: VideoOptions) -> dict[str, np.ndarray]:
    """The cameras that go to mp4 files (none when they are stored as images)."""
    return {} if video.as_images else ep.cameras


def _write_text_table(path: Path, index_column: str, text_column: str, texts: Sequence[str]) -> None:
    """``meta/tasks.parquet`` (or 0.4's ``meta/subtasks.parquet``): ``index_column`` 0..n-1 and the texts, marked as
    the pandas index, so ``pandas.read_parquet`` (LeRobot's reader) gets the text as the index, exactly like a
    file LeRobot wrote."""
    table = pa.table({index_column: pa.array(range(len(texts)), pa.int64()), text_column: list(texts)})
    _write_parquet(path, table.replace_schema_metadata({b"pandas": json.dumps({
        "index_columns": [text_column], "column_indexes": [], "columns": [
            {"name": index_column, "field_name": index_column, "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": text_column, "field_name": text_column, "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ], "creator": {"library": "pyarrow"}, "pandas_version": "2.2.0",
    }).encode()}))


def _info(episodes, version, fps, video, total_tasks, chunks_size, robot_type) -> dict:
    first = episodes[0]
    features = {
        key: {"dtype": str(np.asarray(v).dtype), "shape": list(np.asarray(v).shape[1:]) or [1], "names": None}
        for key, v in first.features.items()
    }
    for key, frames in first.cameras.items():
        height, width = frames.shape[1:3]
        if video.as_images:
            features[key] = {"dtype": "image", "shape": [height, width, 3], "names": ["height", "width", "channel"]}
            continue
        features[key] = {
            "dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
            "info": {"video.height": height, "video.width": width, "video.codec": video.codec,
                     "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": fps,
                     "video.channels": 3, "has_audio": False},
        }
    features.update({
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        **{name: {"dtype": "int64", "shape": [1], "names": None}
           for name in ("frame_index", "episode_index", "index", "task_index")},
    })
    info = {
        "codebase_version": version, "robot_type": robot_type, "total_episodes": len(episodes),
        "total_frames": sum(ep.length for ep in episodes), "total_tasks": total_tasks,
    }
    if version == fmt.V21:
        info.update({"total_videos": len(episodes) * len(_videos(first, video)),
                     "total_chunks": (len(episodes) - 1) // chunks_size + 1, "chunks_size": chunks_size,
                     "fps": fps, "splits": {"train": f"0:{len(episodes)}"}, "data_path": fmt.DATA_PATH_V21,
                     "video_path": fmt.VIDEO_PATH_V21 if _videos(first, video) else None})
    else:
        info.update({"chunks_size": chunks_size, "data_files_size_in_mb": 100, "video_files_size_in_mb": 200,
                     "fps": fps, "splits": {"train": f"0:{len(episodes)}"}, "data_path": fmt.DATA_PATH_V30,
                     "video_path": fmt.VIDEO_PATH_V30 if _videos(first, video) else None})
    info["features"] = features
    return info


def _write_parquet(path: Path, table: pa.Table) -> None:
    """``table`` to ``path``, one row group per episode (as LeRobot's writers keep them) where it has episodes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if "episode_index" not in table.column_names or not table.num_rows:
        pq.write_table(table, path)
        return
    episodes = table.column("episode_index").to_numpy()
    starts = [0, *np.flatnonzero(np.diff(episodes)) + 1, len(episodes)]
    with pq.ParquetWriter(path, table.schema) as writer:
        for begin, end in zip(starts[:-1], starts[1:], strict=True):
            writer.write_table(table.slice(begin, end - begin))


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=4))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
