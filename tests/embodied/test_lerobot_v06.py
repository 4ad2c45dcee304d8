"""LeRobot 0.6 datasets: files LeRobot 0.6.1 itself wrote (tests/embodied/data/lerobot061, made by
make_lerobot061_fixture.py with LeRobot's recorder and annotation writer) read by our reader, and our writer's
``lerobot="0.6"`` / ``"0.4"`` output (subtasks as language columns / as ``subtask_index``) read back.

The fixture's values are a formula of (episode, frame) that this file recomputes (see the generator's docstring);
LeRobot 0.6.1 reading our writer's output is checked outside CI (Python >= 3.12), see docs/guide-embodied.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loongforge.errors import ConfigError
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.lerobot_format import LeRobotFormatError
from loongforge_embodied.data.synthetic import SUBTASKS, write_synthetic_dataset
from loongforge_embodied.task_options import PolicyTaskOptions

FIXTURE = Path(__file__).parent / "data" / "lerobot061"
LENGTHS, FPS = (4, 3, 5), 10
TOP, DEPTH = "observation.images.top", "observation.images.depth"


def _rows():
    return [(e, t) for e, n in enumerate(LENGTHS) for t in range(n)]


def test_lerobot061_files_read_frame_by_frame():
    dataset = LeRobotDataset(FIXTURE, action_horizon=2)
    assert dataset.num_episodes == 3 and len(dataset) == sum(LENGTHS) and dataset.fps == FPS
    assert dataset.camera_keys == [TOP] and dataset.info.depth_keys == [DEPTH]
    assert dataset.info.language_keys == ["language_persistent", "language_events"]
    assert [tool["function"]["name"] for tool in dataset.info.raw["tools"]] == ["say"]  # read, not needed
    for row, (e, t) in enumerate(_rows()):
        item = dataset[row]
        np.testing.assert_array_equal(item["observation.state"], [e, t, 10 * e + t])
        np.testing.assert_allclose(item["action"][0], [t / 10, -e], rtol=1e-6)
        assert item["action_is_pad"].tolist() == [False, t + 1 == LENGTHS[e]]
        np.testing.assert_array_equal(np.round(item[TOP] * 255).astype(int),
                                      np.broadcast_to(np.array([40 * e + 10 * t, 20 * t, 100])[:, None, None],
                                                      (3, 8, 8)))
        assert DEPTH not in item  # a depth map is no camera
        assert item["task"] == ("pick up the cube", "open the drawer")[e % 2]
        # language rows as LeRobot returns them, and the subtask active at the frame's time (grasp from 0.2 s)
        assert item["subtask"] == (f"grasp {e}" if t >= 2 else f"reach {e}") and item["plan"] == ""
        assert {row["content"] for row in item["language_persistent"]} == {f"reach {e}", f"grasp {e}",
                                                                          f"please do task {e}"}
        assert [row["content"] for row in item["language_events"]] == ([f"careful {e}"] if t == 1 else [])
    assert "depth maps ['observation.images.depth'] (not read)" in dataset.describe()


def test_depth_maps_are_refused_in_one_line_naming_them():
    with pytest.raises(ValueError, match=f"'{DEPTH}', a depth map"):
        LeRobotDataset(FIXTURE, delta_timestamps={DEPTH: [0.0]})
    dataset = LeRobotDataset(FIXTURE)
    with pytest.raises(ConfigError, match=f"'{DEPTH}' of .* is a depth map") as err:
        PolicyTaskOptions(cameras=[DEPTH]).camera_keys(1, dataset.camera_keys, FIXTURE, "run.yaml",
                                                       dataset.info.depth_keys)
    assert "\n" not in str(err.value)


def test_fields_and_columns_of_a_later_lerobot_are_passed_through(tmp_path):
    """info.json keys and feature dtypes the reader does not know, and a nested column, neither crash nor get
    read as numbers: each frame carries the column's Python value."""
    root = tmp_path / "future"
    shutil.copytree(FIXTURE, root)
    info = json.loads((root / "meta/info.json").read_text())
    info["camera_calibration"] = {"top": [1, 2, 3]}
    info["features"]["observation.points"] = {"dtype": "pointcloud", "shape": [2, 3], "names": None}
    (root / "meta/info.json").write_text(json.dumps(info))
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    points = [[{"x": float(i), "tag": f"p{i}"}] * (i % 3) for i in range(table.num_rows)]
    pq.write_table(table.append_column("observation.points", pa.array(points)), path)
    dataset = LeRobotDataset(root)
    assert [dataset[i]["observation.points"] for i in (0, 4)] == [points[0], points[4]]
    np.testing.assert_array_equal(dataset[4]["observation.state"], [1, 0, 10])


def test_an_ambiguous_subtask_names_the_file_and_episode(tmp_path):
    root = tmp_path / "ambiguous"
    shutil.copytree(FIXTURE, root)
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    rows = table.column("language_persistent").to_pylist()
    rows[0] = rows[0] + [{**rows[0][0], "content": "other"}]  # two subtasks start at 0 s in episode 0
    index = table.column_names.index("language_persistent")
    pq.write_table(table.set_column(index, "language_persistent", pa.array(rows, table.schema.field(index).type)),
                   path)
    dataset = LeRobotDataset(root)
    with pytest.raises(LeRobotFormatError, match="episode 0, frame 0: language_persistent: .*ambiguous"):
        dataset[0]


@pytest.mark.parametrize("lerobot", ["0.6", "0.4"])
def test_our_subtask_annotations_read_back(tmp_path, lerobot):
    root, episodes = write_synthetic_dataset(tmp_path / lerobot, version="v3.0", codec="h264", lengths=(4, 5),
                                             subtasks=True, lerobot=lerobot)
    info = json.loads((root / "meta/info.json").read_text())
    video = info["features"][TOP]["info"]
    columns = pq.read_schema(root / "data/chunk-000/file-000.parquet").names
    if lerobot == "0.6":
        assert info["features"]["language_persistent"]["dtype"] == "language" and "subtask_index" not in columns
        assert video["is_depth_map"] is False and video["video.g"] == 2 and "video.is_depth_map" not in video
        assert list(info)[:3] == ["codebase_version", "fps", "features"]
    else:
        assert "subtask_index" in columns and "language_persistent" not in columns
        assert video["video.is_depth_map"] is False and "video.g" not in video
        assert pq.read_table(root / "meta/subtasks.parquet").column("subtask").to_pylist() == list(SUBTASKS)
    assert pq.ParquetFile(root / "data/chunk-000/file-000.parquet").num_row_groups == 2  # one per episode
    dataset = LeRobotDataset(root)
    got = [dataset[i]["subtask"] for i in range(len(dataset))]
    assert got == [SUBTASKS[t >= n // 2] for n in (4, 5) for t in range(n)]
    assert [ep.subtasks for ep in episodes] == [[(0.0, SUBTASKS[0]), (0.2, SUBTASKS[1])],
                                                [(0.0, SUBTASKS[0]), (0.2, SUBTASKS[1])]]


def test_lerobot06_writes_v30_only(tmp_path):
    with pytest.raises(ConfigError, match="LeRobot 0.6 reads and writes LeRobotDataset v3.0 only, not v2.1"):
        write_synthetic_dataset(tmp_path / "x", version="v2.1", lerobot="0.6")
