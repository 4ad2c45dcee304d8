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

This module turns either into one list of :class:`EpisodeEntry` so the reader does not care which it got. Every
file it reads is checked as it is parsed (JSON that does not parse, parquet that pyarrow cannot open, missing keys
and columns, values of the wrong type): a malformed dataset raises :class:`LeRobotFormatError` naming the file and,
where one is concerned, the episode -- never a raw pyarrow or ``KeyError`` traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loongforge.errors import LoongForgeError

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


class LeRobotFormatError(LoongForgeError, ValueError):
    """A dataset on disk is not a readable LeRobotDataset; the message names the file and the episode.

    A :class:`~loongforge.errors.LoongForgeError`, so ``loongforge check`` / ``train`` print it as one line; still
    a ``ValueError`` for callers that caught it as one."""


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
    #: The metadata file that lists the episode (relative to the root), for messages.
    meta_path: str = ""


@dataclass(frozen=True)
class DatasetInfo:
    """The parts of ``meta/info.json`` the reader needs, plus the whole of it in ``raw`` (fields it does not know,
    such as LeRobot 0.6's ``tools``, stay there unread)."""

    version: str
    fps: int
    features: dict[str, dict[str, Any]]
    chunks_size: int
    raw: dict[str, Any]

    @property
    def video_keys(self) -> list[str]:
        """Features stored as mp4 files (RGB cameras and depth maps alike)."""
        return [key for key, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        """Features stored as encoded images inside the parquet files (RGB cameras and depth maps alike)."""
        return [key for key, ft in self.features.items() if ft["dtype"] == "image"]

    @property
    def depth_keys(self) -> list[str]:
        """Video or image features LeRobot 0.6 marks as depth maps (``info.is_depth_map``, or the older
        ``video.is_depth_map`` that LeRobot 0.4 wrote ``false`` on every video): single-channel distances, not
        RGB, so they are never read as cameras."""
        return [key for key, ft in self.features.items() if ft["dtype"] in ("video", "image") and is_depth_map(ft)]

    @property
    def camera_keys(self) -> list[str]:
        """The RGB cameras (videos, then images): what policies read as images."""
        depth = set(self.depth_keys)
        return [key for key in self.video_keys + self.image_keys if key not in depth]

    @property
    def data_keys(self) -> list[str]:
        """Numeric features stored in the parquet files (states, actions, indices)."""
        return [key for key, ft in self.features.items() if numeric_dtype(ft["dtype"]) is not None]

    @property
    def language_keys(self) -> list[str]:
        """LeRobot 0.6's language annotation columns (dtype ``language``: ``language_persistent`` rows that hold from
        their timestamp on, ``language_events`` rows on the frame they happen at)."""
        return [key for key, ft in self.features.items() if ft["dtype"] == LANGUAGE_DTYPE]

    @property
    def passthrough_keys(self) -> list[str]:
        """Other parquet features -- strings, language rows, dtypes a later LeRobot adds: read as Python values
        per frame, never as numbers."""
        return [key for key, ft in self.features.items()
                if ft["dtype"] not in ("video", "image") and numeric_dtype(ft["dtype"]) is None]


#: LeRobot 0.6's feature dtype of the two language columns.
LANGUAGE_DTYPE = "language"


def is_depth_map(feature: dict[str, Any]) -> bool:
    """Whether a feature of info.json is a depth map: LeRobot 0.6 writes ``info.is_depth_map``; older sets
    ``info["video.is_depth_map"]`` or ``video_info["video.is_depth_map"]`` (LeRobot 0.6 reads all three)."""
    info = feature.get("info") if isinstance(feature.get("info"), dict) else {}
    video_info = feature.get("video_info") if isinstance(feature.get("video_info"), dict) else {}
    return bool(info.get("is_depth_map") or info.get("video.is_depth_map") or video_info.get("video.is_depth_map"))


def numeric_dtype(name: Any) -> np.dtype | None:
    """The numpy dtype an info.json ``dtype`` names when it is numeric (``float32``, ``int64``, ``bool``), else
    ``None`` (``string``, ``video``, ``language``, unknown names)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    return dtype if np.issubdtype(dtype, np.number) or dtype == np.bool_ else None


def one_line(err: BaseException) -> str:
    """``err`` as ``Type: text`` on one line (pyarrow's and PyAV's messages may span several)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def read_json(path: Path) -> Any:
    """A JSON metadata file; one that cannot be read or does not parse is an error naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise LeRobotFormatError(f"{path}: cannot be read ({one_line(err)})") from None
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, nesting deeper than the parser goes
        raise LeRobotFormatError(f"{path}: not valid JSON ({one_line(err)})") from None


def read_parquet(path: Path, *, columns: list[str] | None = None, episode: int | None = None) -> pa.Table:
    """A parquet file as a table; a missing, truncated or corrupt file is an error naming it (and ``episode``)."""
    with _unreadable_parquet(path, episode):
        return pq.read_table(path, columns=columns)


def parquet_columns(path: Path) -> list[str]:
    """The column names of a parquet file (its footer alone), checked like :func:`read_parquet`."""
    with _unreadable_parquet(path, None):
        return pq.read_schema(path).names


@contextmanager
def _unreadable_parquet(path: Path, episode: int | None) -> Iterator[None]:
    try:
        yield
    except (pa.ArrowException, OSError) as err:
        where = f" (episode {episode})" if episode is not None else ""
        raise LeRobotFormatError(f"{path}: not a readable parquet file{where} ({one_line(err)})") from None


@contextmanager
def row_errors(path: Path, row: str) -> Iterator[None]:
    """Turn the ``KeyError`` / ``TypeError`` / ``ValueError`` of reading one metadata row (a missing key, a null,
    text where a number belongs) into a :class:`LeRobotFormatError` naming the file and ``row``."""
    try:
        yield
    except LeRobotFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        problem = f"no key {err}" if isinstance(err, KeyError) else one_line(err)
        raise LeRobotFormatError(f"{path}: {row}: malformed ({problem})") from None


def read_info(root: Path) -> DatasetInfo:
    """Parse and check ``meta/info.json``: a JSON object with a supported ``codebase_version``, a positive integer
    ``fps`` and ``features`` mapping each name to its ``dtype`` and ``shape``."""
    path = root / INFO_PATH
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing; is {root} a LeRobotDataset root (meta/, data/, videos/)?")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise LeRobotFormatError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    version = raw.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise LeRobotFormatError(
            f"{path}: codebase_version {version!r} is not supported; readable: {', '.join(SUPPORTED_VERSIONS)} "
            "(upgrade older datasets with LeRobot's conversion scripts, v2.0 -> v2.1 -> v3.0)"
        )
    missing = [key for key in ("fps", "features") if key not in raw]
    if missing:
        raise LeRobotFormatError(f"{path}: missing key(s) {missing}")
    fps, chunks_size = _positive_int(raw["fps"]), _positive_int(raw.get("chunks_size", 1000))
    if fps is None:
        raise LeRobotFormatError(f"{path}: 'fps' must be a positive integer, got {raw['fps']!r}")
    if chunks_size is None:
        raise LeRobotFormatError(f"{path}: 'chunks_size' must be a positive integer, got {raw['chunks_size']!r}")
    features = raw["features"]
    if not isinstance(features, dict) or not features:
        raise LeRobotFormatError(f"{path}: 'features' must map feature names to their dtype and shape")
    for name, feature in features.items():
        problem = _feature_problem(feature)
        if problem:
            raise LeRobotFormatError(f"{path}: features['{name}']: {problem}")
    return DatasetInfo(version, fps, features, chunks_size, raw)


def _positive_int(value: Any) -> int | None:
    """``value`` as an int when it is a positive whole number (``30`` or ``30.0``), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if value > 0 and float(value).is_integer() else None


def _feature_problem(feature: Any) -> str | None:
    """What is wrong with one ``features`` entry of info.json, or ``None``."""
    if not isinstance(feature, dict) or not isinstance(feature.get("dtype"), str):
        return f"must be a mapping with a string 'dtype', got {feature!r}"
    shape = feature.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        return f"'shape' must be a list of non-negative integers, got {shape!r}"
    return None


def read_episodes(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    """The episode table of either version, in episode order."""
    entries = _episodes_v21(root, info) if info.version == V21 else _episodes_v30(root, info)
    return sorted(entries, key=lambda e: e.index)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one per non-empty line; a bad line is an error naming it."""
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as err:
        raise LeRobotFormatError(f"{path}: cannot be read ({one_line(err)})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise LeRobotFormatError(f"{path}, line {number}: not valid JSON ({one_line(err)})") from None
        if not isinstance(row, dict):
            raise LeRobotFormatError(f"{path}, line {number}: must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_tasks(root: Path, info: DatasetInfo) -> dict[int, str]:
    """``task_index -> task text``. v3.0 keeps the text as the pandas index of ``tasks.parquet``; written by
    pandas it is a column named ``task`` (or ``__index_level_0__`` when the index had no name)."""
    if info.version == V21:
        path = root / TASKS_JSONL
        tasks = {}
        for number, row in enumerate(read_jsonl(path)):
            with row_errors(path, f"task row {number}"):
                tasks[int(row["task_index"])] = str(row["task"])
        return tasks
    return read_text_table(root / TASKS_PARQUET, "task_index", "task")


def read_text_table(path: Path, index_column: str, text_name: str) -> dict[int, str]:
    """``index -> text`` of a table LeRobot writes with pandas, the text as its index (``meta/tasks.parquet``,
    LeRobot 0.4's ``meta/subtasks.parquet``): a column named ``text_name``, or ``__index_level_0__`` when the
    index had no name."""
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: missing")
    table = read_parquet(path)
    text_column = next((c for c in (text_name, "__index_level_0__") if c in table.column_names), None)
    if text_column is None or index_column not in table.column_names:
        raise LeRobotFormatError(f"{path}: needs columns '{index_column}' and '{text_name}' (the text); columns: "
                                 f"{table.column_names}")
    with row_errors(path, f"column '{index_column}'"):
        indices = [int(i) for i in table.column(index_column).to_pylist()]
    return dict(zip(indices, (str(t) for t in table.column(text_column).to_pylist()), strict=True))


def _template(root: Path, info: DatasetInfo, key: str, default: str, **values: Any) -> str:
    """``info.json``'s path template ``key`` (or the version's default) filled with ``values``."""
    template = info.raw.get(key) or default
    try:
        return str(template).format(**values)
    except (KeyError, IndexError, ValueError) as err:
        raise LeRobotFormatError(f"{root / INFO_PATH}: '{key}' {template!r} is not a path template of "
                                 f"{sorted(values)} ({one_line(err)})") from None


def _episodes_v21(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    path = root / EPISODES_JSONL
    listed = []
    for number, row in enumerate(read_jsonl(path)):
        with row_errors(path, f"row {number} (episode {row.get('episode_index')})"):
            listed.append((int(row["episode_index"]), int(row["length"]), tuple(row.get("tasks") or ())))
    entries, start = [], 0
    for index, length, tasks in sorted(listed):
        chunk = index // info.chunks_size
        videos = {key: VideoSpan(_template(root, info, "video_path", VIDEO_PATH_V21, episode_chunk=chunk,
                                           video_key=key, episode_index=index), 0.0)
                  for key in info.video_keys}
        data_path = _template(root, info, "data_path", DATA_PATH_V21, episode_chunk=chunk, episode_index=index)
        entries.append(EpisodeEntry(index, length, tasks, data_path, start, videos, EPISODES_JSONL))
        start += length
    return entries


def _episodes_v30(root: Path, info: DatasetInfo) -> list[EpisodeEntry]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise LeRobotFormatError(f"{root / 'meta' / 'episodes'}: no episode table (chunk-*/file-*.parquet)")
    required = ["episode_index", "dataset_from_index", "dataset_to_index", "data/chunk_index", "data/file_index"]
    required += [f"videos/{key}/{name}" for key in info.video_keys
                 for name in ("chunk_index", "file_index", "from_timestamp")]
    entries = []
    for file in files:
        names = parquet_columns(file)
        missing = [c for c in required if c not in names]
        if missing:
            raise LeRobotFormatError(f"{file}: the episode table lacks columns {missing}")
        table = read_parquet(file, columns=[c for c in names if not c.startswith("stats/")])
        for number, row in enumerate(table.to_pylist()):
            with row_errors(file, f"row {number} (episode {row.get('episode_index')})"):
                entries.append(_entry_v30(file, root, info, row))
    return entries


def _entry_v30(file: Path, root: Path, info: DatasetInfo, row: dict[str, Any]) -> EpisodeEntry:
    """One row of a v3.0 episode table as an entry (its ``length``, when given, must match its row range)."""
    videos = {
        key: VideoSpan(
            _template(root, info, "video_path", VIDEO_PATH_V30, video_key=key,
                      chunk_index=int(row[f"videos/{key}/chunk_index"]),
                      file_index=int(row[f"videos/{key}/file_index"])),
            float(row[f"videos/{key}/from_timestamp"]),
        )
        for key in info.video_keys
    }
    start = int(row["dataset_from_index"])
    length = int(row["dataset_to_index"]) - start
    if row.get("length") is not None and int(row["length"]) != length:
        raise LeRobotFormatError(
            f"{file}: episode {row['episode_index']}: length {row['length']} disagrees with "
            f"dataset_to_index - dataset_from_index = {length}"
        )
    data_path = _template(root, info, "data_path", DATA_PATH_V30, chunk_index=int(row["data/chunk_index"]),
                          file_index=int(row["data/file_index"]))
    return EpisodeEntry(int(row["episode_index"]), length, tuple(row.get("tasks") or ()), data_path, start, videos,
                        str(file.relative_to(root)))
