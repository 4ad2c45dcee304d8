"""Malformed LeRobot datasets: each is the tiny valid dataset of :func:`write_synthetic_dataset` (3 episodes of 12,
15 and 10 frames; in v3.0 episodes 0 and 1 share ``file-000`` and episode 2 is alone in ``file-001``) with one fault
written into it, and the text the one-line error about it must contain (the file and, where one is concerned, the
episode).

Used by ``test_lerobot_errors.py`` (through the reader, ``loongforge check`` and ``loongforge train``) and meant for
the repo-wide fuzz suite. The API::

    from lerobot_faults import FAULTS, RECIPE, run_overrides
    for fault in FAULTS:                                   # LeRobotFault(name, make, expected)
        root = fault.make(tmp_path / fault.name)           # writes the broken dataset there; returns its root
        argv = ["check", RECIPE, *run_overrides(root, tmp_path / "run")]   # or "train"
        # -> exit 2, stderr is one line "error: ...", and fault.expected is in it

This file is not a test module; import it with ``tests/embodied`` on ``sys.path`` (pytest puts it there for the
tests beside it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from loongforge_embodied.data.synthetic import write_synthetic_dataset

#: The embodied recipe the faults are trained with (relative to the repository root).
RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "embodied-tiny.yaml")
CAM = "observation.images.top"
STATE = "observation.state"
DATA_0, DATA_1 = "data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet"
VIDEO_0, VIDEO_1 = f"videos/{CAM}/chunk-000/file-000.mp4", f"videos/{CAM}/chunk-000/file-001.mp4"
EPISODES = "meta/episodes/chunk-000/file-000.parquet"
INFO, STATS, TASKS = "meta/info.json", "meta/stats.json", "meta/tasks.parquet"
#: Rows of episode 1 start here in DATA_0 (episode 0 has 12 frames).
EPISODE_1_START = 12


@dataclass(frozen=True)
class LeRobotFault:
    """One malformed dataset: ``make(directory)`` writes it under ``directory`` and returns its root;
    ``expected`` is a substring of the one-line error every entry point must give for it."""

    name: str
    make: Callable[[Path], Path]
    expected: str


def run_overrides(root: Path, output_dir: Path) -> list[str]:
    """``KEY=VALUE`` overrides that point :data:`RECIPE` at ``root`` for one cheap step (3 episodes: 1 held out)."""
    return [f"task.data={root}", "task.held_out_episodes=1", "training.steps=1", "task.eval.frames=0",
            f"run.output_dir={output_dir}"]


def _fault(name: str, expected: str, version: str = "v3.0") -> Callable[[Callable[[Path], Any]], LeRobotFault]:
    """Register ``break_it(root)`` as the fault ``name``: the dataset is written, then broken in place."""
    def register(break_it: Callable[[Path], Any]) -> LeRobotFault:
        def make(directory: Path) -> Path:
            root, _ = write_synthetic_dataset(Path(directory) / "dataset", version=version)
            break_it(root)
            return root

        fault = LeRobotFault(name, make, expected)
        FAULTS.append(fault)
        return fault

    return register


FAULTS: list[LeRobotFault] = []


# -- helpers that edit a written dataset ---------------------------------------------------------------------------
def _edit_column(path: Path, name: str, edit: Callable[[list], list], type_: pa.DataType | None = None) -> None:
    """Replace column ``name`` of the parquet ``path`` by ``edit(its values as Python lists)``."""
    table = pq.read_table(path)
    values = edit(table.column(name).to_pylist())
    column = pa.array(values, type=type_ or table.schema.field(name).type)
    pq.write_table(table.set_column(table.column_names.index(name), name, column), path)


def _edit_json(path: Path, edit: Callable[[dict], Any]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))  # json.dumps writes NaN as the bare token NaN, as Python's json reads it


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garble(path: Path) -> None:
    """Same size, seeded random bytes."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def _set_frame(path: Path, name: str, row: int, column: int, value: float) -> None:
    def poison(rows: list) -> list:
        rows[row][column] = value
        return rows

    _edit_column(path, name, poison)


def _replace(value: Any, by: Any) -> Callable[[list], list]:
    return lambda values: [by if v == value else v for v in values]


# -- files missing or unreadable -----------------------------------------------------------------------------------
@_fault("missing-data-file", f"{DATA_1}: data file of episode 2 is missing")
def _(root: Path) -> None:
    (root / DATA_1).unlink()


@_fault("truncated-data-file", f"{DATA_1}: not a readable parquet file (episode 2)")
def _(root: Path) -> None:
    _truncate(root / DATA_1)


@_fault("corrupt-episode-table", f"{EPISODES}: not a readable parquet file")
def _(root: Path) -> None:
    _garble(root / EPISODES)


@_fault("missing-episode-table", "meta/episodes: no episode table")
def _(root: Path) -> None:
    shutil.rmtree(root / "meta/episodes")


@_fault("missing-tasks", f"{TASKS}: missing")
def _(root: Path) -> None:
    (root / TASKS).unlink()


@_fault("missing-video-file", f"{VIDEO_1}: video file of episode 2 ({CAM}) is missing")
def _(root: Path) -> None:
    (root / VIDEO_1).unlink()


@_fault("corrupt-video", f"{VIDEO_0}: episode 0 ({CAM}): not a readable video")
def _(root: Path) -> None:
    _garble(root / VIDEO_0)


@_fault("truncated-video", f"{VIDEO_0}: episode 0 ({CAM}): not a readable video")
def _(root: Path) -> None:
    _truncate(root / VIDEO_0)


# -- info.json -----------------------------------------------------------------------------------------------------
@_fault("info-bad-json", f"{INFO}: not valid JSON")
def _(root: Path) -> None:
    _truncate(root / INFO)


@_fault("info-not-utf8", f"{INFO}: not valid JSON (UnicodeDecodeError")
def _(root: Path) -> None:
    (root / INFO).write_bytes(b'{"codebase_version": "v3.0", "fps": 10, "robot_type": "\xff\xfe"}')


@_fault("info-missing-fps", f"{INFO}: missing key(s) ['fps']")
def _(root: Path) -> None:
    _edit_json(root / INFO, lambda info: info.pop("fps"))


@_fault("info-wrong-version", f"{INFO}: codebase_version 'v2.0' is not supported")
def _(root: Path) -> None:
    _edit_json(root / INFO, lambda info: info.update(codebase_version="v2.0"))


@_fault("info-shape-disagrees", f"{DATA_0}: column '{STATE}' has 4 value(s) per frame, but {INFO} gives shape [5] "
                                "(episode 0)")
def _(root: Path) -> None:
    _edit_json(root / INFO, lambda info: info["features"][STATE].update(shape=[5]))


# -- the episode table ---------------------------------------------------------------------------------------------
@_fault("empty-dataset", "the dataset has no episodes")
def _(root: Path) -> None:
    table = pq.read_table(root / EPISODES)
    pq.write_table(table.slice(0, 0), root / EPISODES)


@_fault("episode-table-missing-column", f"{EPISODES}: the episode table lacks columns ['dataset_from_index']")
def _(root: Path) -> None:
    table = pq.read_table(root / EPISODES)
    pq.write_table(table.drop_columns(["dataset_from_index"]), root / EPISODES)


@_fault("episode-index-out-of-range", f"{EPISODES}: episode index 7 is out of range; indices are 0..2")
def _(root: Path) -> None:
    _edit_column(root / EPISODES, "episode_index", _replace(2, 7))
    _edit_column(root / DATA_1, "episode_index", _replace(2, 7))


@_fault("episode-length-disagrees", f"{EPISODES} gives episode 2 length 11")
def _(root: Path) -> None:
    _edit_column(root / EPISODES, "dataset_to_index", _replace(37, 38))
    _edit_column(root / EPISODES, "length", _replace(10, 11))


@_fault("episode-rows-mislabelled", f"{DATA_1}: rows for episode 2 (global index 27..36) have episode_index [1]")
def _(root: Path) -> None:
    _edit_column(root / DATA_1, "episode_index", _replace(2, 1))


# -- data columns --------------------------------------------------------------------------------------------------
@_fault("action-as-text", f"{DATA_1}: column 'action' holds object values, but {INFO} declares float32 (episode 2)")
def _(root: Path) -> None:
    _edit_column(root / DATA_1, "action", lambda rows: [[f"{v:.3f}" for v in row] for row in rows],
                 pa.list_(pa.string()))


@_fault("missing-state-column", f"{DATA_1}: columns ['{STATE}'] are missing (episode 2)")
def _(root: Path) -> None:
    pq.write_table(pq.read_table(root / DATA_1).drop_columns([STATE]), root / DATA_1)


@_fault("nan-state", f"{DATA_1}: episode 2, frame 4: '{STATE}' is not finite")
def _(root: Path) -> None:
    _set_frame(root / DATA_1, STATE, 4, 0, float("nan"))


@_fault("inf-action", f"{DATA_0}: episode 1, frame 0: 'action' is not finite")
def _(root: Path) -> None:
    _set_frame(root / DATA_0, "action", EPISODE_1_START, 2, float("inf"))


@_fault("task-index-out-of-range", f"{DATA_1}: episode 2, frame 0: task_index 5 is not in")
def _(root: Path) -> None:
    _edit_column(root / DATA_1, "task_index", lambda values: [5] * len(values))


# -- stats.json ----------------------------------------------------------------------------------------------------
@_fault("stats-bad-json", f"{STATS}: not valid JSON")
def _(root: Path) -> None:
    _truncate(root / STATS)


@_fault("stats-wrong-width", f"{STATS}: 'action' mean has 2 value(s), but the feature has 3 (shape [3])")
def _(root: Path) -> None:
    _edit_json(root / STATS, lambda stats: stats["action"].update(mean=stats["action"]["mean"][:2]))


@_fault("stats-nan", f"{STATS}: '{STATE}' std is not finite")
def _(root: Path) -> None:
    _edit_json(root / STATS, lambda stats: stats[STATE].update(std=[float("nan")] * 4))


# -- LeRobot v2.1 (one parquet and one mp4 per episode, JSON-lines metadata) ----------------------------------------
@_fault("v21-episodes-bad-line", "meta/episodes.jsonl, line 2: not valid JSON", version="v2.1")
def _(root: Path) -> None:
    path = root / "meta/episodes.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:10]
    path.write_text("\n".join(lines) + "\n")


@_fault("v21-missing-episode-file", "data/chunk-000/episode_000001.parquet: data file of episode 1 is missing",
        version="v2.1")
def _(root: Path) -> None:
    (root / "data/chunk-000/episode_000001.parquet").unlink()


@_fault("v21-episode-stats-malformed", "meta/episodes_stats.jsonl: episode 2: 'action' min: not numbers",
        version="v2.1")
def _(root: Path) -> None:
    path = root / "meta/episodes_stats.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[2]["stats"]["action"]["min"] = ["low", "lower", "lowest"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
