"""A broken LeRobotDataset fails when opened (or read) with one line naming the file and the episode."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.lerobot_format import LeRobotFormatError
from loongforge_embodied.data.synthetic import write_synthetic_dataset

CAM = "observation.images.top"
# Where episode 1 lives in each layout (v3.0 keeps episodes 0 and 1 in file-000, episode 2 in file-001).
EPISODE_1_DATA = {"v2.1": "data/chunk-000/episode_000001.parquet", "v3.0": "data/chunk-000/file-000.parquet"}
EPISODE_2_VIDEO = {"v2.1": f"videos/chunk-000/{CAM}/episode_000002.mp4",
                   "v3.0": f"videos/{CAM}/chunk-000/file-001.mp4"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return {v: write_synthetic_dataset(tmp_path_factory.mktemp(v), version=v)[0] for v in ("v2.1", "v3.0")}


@pytest.fixture(params=["v2.1", "v3.0"])
def copy(request, pristine, tmp_path):
    """A fresh copy of the tiny dataset of one version, to break."""
    return request.param, shutil.copytree(pristine[request.param], tmp_path / "dataset")


def _open_error(root, **kwargs) -> str:
    with pytest.raises(LeRobotFormatError) as caught:
        LeRobotDataset(root, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def _rewrite_column(path, name, edit):
    table = pq.read_table(path)
    values = edit(np.array(table.column(name).to_pylist()))
    column = pa.array(values.tolist(), type=table.schema.field(name).type)
    pq.write_table(table.set_column(table.column_names.index(name), name, column), path)


def test_the_pristine_copies_open(copy):
    _, root = copy
    assert len(LeRobotDataset(root)) == 37


def test_missing_video_file(copy):
    version, root = copy
    (root / EPISODE_2_VIDEO[version]).unlink()
    message = _open_error(root)
    assert EPISODE_2_VIDEO[version] in message and "episode 2" in message and "missing" in message


def test_episode_index_disagreeing_with_metadata(copy):
    version, root = copy
    path = root / EPISODE_1_DATA[version]

    def relabel_episode_1(values):
        values[values == 1] = 5
        return values

    _rewrite_column(path, "episode_index", relabel_episode_1)
    message = _open_error(root)
    assert EPISODE_1_DATA[version] in message and "episode 1" in message and "episode_index [5]" in message


def test_nan_action(copy):
    version, root = copy
    frame = 3 if version == "v2.1" else 12 + 3  # v3.0: episode 1 starts at row 12 of file-000

    def poison(values):
        values[frame, 1] = np.nan
        return values

    _rewrite_column(root / EPISODE_1_DATA[version], "action", poison)
    message = _open_error(root)
    assert EPISODE_1_DATA[version] in message and "episode 1, frame 3: 'action' is not finite" in message


def test_wrong_codebase_version(copy):
    _, root = copy
    info_path = root / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["codebase_version"] = "v2.0"
    info_path.write_text(json.dumps(info))
    message = _open_error(root)
    assert "meta/info.json" in message and "'v2.0' is not supported" in message and "v2.1, v3.0" in message


def test_episode_length_disagreeing_with_the_rows(copy):
    version, root = copy
    if version == "v2.1":
        path = root / "meta/episodes.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[1]["length"] = 14
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        message = _open_error(root)
        assert "episode_000001.parquet: 15 rows" in message and "episode 1 length 14" in message
    else:
        path = root / "meta/episodes/chunk-000/file-000.parquet"
        _rewrite_column(path, "length", lambda v: v + np.array([0, 1, 0]))
        message = _open_error(root)
        assert "file-000.parquet" in message and "episode 1: length 16" in message


def test_video_shorter_than_its_episode_fails_on_read(pristine, tmp_path):
    """Episode 0 (12 frames) given episode 2's 10-frame video: frame 11 has no picture."""
    root = shutil.copytree(pristine["v2.1"], tmp_path / "dataset")
    video_dir = root / "videos/chunk-000" / CAM
    shutil.copy(video_dir / "episode_000002.mp4", video_dir / "episode_000000.mp4")
    dataset = LeRobotDataset(root)
    dataset[9]
    with pytest.raises(LeRobotFormatError) as caught:
        dataset[11]
    message = str(caught.value)
    assert "episode_000000.mp4: episode 0" in message and "no frame within" in message and "\n" not in message


def test_dropped_frame_in_timestamps(copy):
    version, root = copy
    frame = 6 if version == "v2.1" else 12 + 6

    def drop_a_frame(values):
        values[frame:frame + 9] += np.float32(0.1)  # frame 6 of episode 1 comes 0.2 s after frame 5
        return values

    _rewrite_column(root / EPISODE_1_DATA[version], "timestamp", drop_a_frame)
    message = _open_error(root)
    assert EPISODE_1_DATA[version] in message and "episode 1, frame 6: timestamp 0.7000 s is 0.2000 s" in message


def test_ragged_list_column(pristine, tmp_path):
    root = shutil.copytree(pristine["v2.1"], tmp_path / "dataset")
    path = root / EPISODE_1_DATA["v2.1"]
    table = pq.read_table(path)
    rows = table.column("action").to_pylist()
    rows[4] = rows[4][:2]
    ragged = pa.array(rows, type=pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.column_names.index("action"), "action", ragged), path)
    message = _open_error(root)
    assert "episode_000001.parquet: column 'action'" in message and "different lengths" in message
    assert "(episode 1)" in message
