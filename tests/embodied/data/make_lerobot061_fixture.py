"""Writes tests/embodied/data/lerobot061/ with LeRobot 0.6.1's own code (run where LeRobot 0.6.1 is installed:
Python >= 3.12, ``pip install "lerobot[dataset]==0.6.1"``; CI has no LeRobot 0.6 and reads the committed files).

Three episodes (4, 3 and 5 frames at 10 fps) recorded with ``LeRobotDataset.create`` / ``add_frame`` /
``save_episode`` / ``finalize``: a state, an action, an RGB camera stored as images in the parquet and a depth camera
(``info.is_depth_map``, uint16 millimetres, TIFF cells). Values are a formula of (episode, frame) so a test recomputes
them without this file: ``state = [e, t, 10e + t]``, ``action = [t / 10, -e]``, the RGB frame is filled with
``(40e + 10t, 20t, 100)`` and the depth frame with ``1000 + 100e + t`` mm. Then LeRobot's annotation writer adds the
language columns: episode ``e`` gets the subtasks ``"reach {e}"`` from 0 s and ``"grasp {e}"`` from 0.2 s and a
``task_aug`` rephrasing (``language_persistent``) and one ``interjection`` event on frame 1 (``language_events``).

    python tests/embodied/data/make_lerobot061_fixture.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from lerobot.annotations.steerable_pipeline.executor import Executor
from lerobot.annotations.steerable_pipeline.writer import (
    LanguageColumnsWriter,
    _normalize_event_row,
    _normalize_persistent_row,
)
from lerobot.datasets.io_utils import write_table_one_row_group_per_episode
from lerobot.datasets.lerobot_dataset import LeRobotDataset

FPS, LENGTHS, SIZE = 10, (4, 3, 5), 8
TASKS = ("pick up the cube", "open the drawer")


def features() -> dict:
    return {
        "observation.state": {"dtype": "float32", "shape": (3,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        "observation.images.top": {"dtype": "image", "shape": (SIZE, SIZE, 3), "names": ["height", "width", "channel"]},
        "observation.images.depth": {"dtype": "image", "shape": (SIZE, SIZE, 1),
                                     "names": ["height", "width", "channel"], "info": {"is_depth_map": True}},
    }


def record(root: Path) -> LeRobotDataset:
    dataset = LeRobotDataset.create("local/lerobot061-fixture", FPS, features=features(), root=root,
                                    use_videos=False)
    for e, length in enumerate(LENGTHS):
        for t in range(length):
            dataset.add_frame({
                "observation.state": np.array([e, t, 10 * e + t], np.float32),
                "action": np.array([t / 10, -e], np.float32),
                "observation.images.top": np.full((SIZE, SIZE, 3), (40 * e + 10 * t, 20 * t, 100), np.uint8),
                "observation.images.depth": np.full((SIZE, SIZE, 1), 1000 + 100 * e + t, np.uint16),
                "task": TASKS[e % 2],
            })
        dataset.save_episode()
    dataset.finalize()
    return dataset


def annotate(root: Path) -> None:
    """The language columns, through LeRobot's annotation writer (its row normalisation and table layout)."""
    writer = LanguageColumnsWriter()
    for path in sorted((root / "data").glob("chunk-*/file-*.parquet")):
        table = pq.read_table(path)
        episodes = table.column("episode_index").to_pylist()
        stamps = table.column("timestamp").to_pylist()
        persistent, events = [], []
        for e, ts in zip(episodes, stamps, strict=True):
            persistent.append([_normalize_persistent_row(row) for row in (
                {"role": "assistant", "content": f"reach {e}", "style": "subtask", "timestamp": 0.0},
                {"role": "user", "content": f"please do task {e}", "style": "task_aug", "timestamp": 0.0},
                {"role": "assistant", "content": f"grasp {e}", "style": "subtask", "timestamp": np.float32(0.2)},
            )])
            events.append([_normalize_event_row({"role": "user", "content": f"careful {e}",
                                                 "style": "interjection"})] if round(ts * FPS) == 1 else [])
        new = writer._materialize_table(table, persistent, events, drop_old=True)
        tmp = path.with_suffix(".tmp")
        write_table_one_row_group_per_episode(new, tmp)
        tmp.replace(path)
    Executor._ensure_annotation_metadata_in_info(root)


def main(out: str) -> None:
    root = Path(out)
    if root.exists():
        shutil.rmtree(root)
    record(root)
    annotate(root)
    print(f"wrote {root}")


if __name__ == "__main__":
    main(sys.argv[1])
