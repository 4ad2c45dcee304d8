"""LeRobotDataset v2.1 and v3.0 written from known episodes read back: layout, values, frames, action chunks."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loongforge_embodied.data.kind import lerobot_dataset
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.synthetic import TINY_LENGTHS, write_synthetic_dataset

CAM = "observation.images.top"
FPS = 10
HORIZON = 5
# (version, codec): H.264 in both layouts, AV1 (LeRobot's default codec) in v3.0, PNG cells in the parquet.
CASES = [("v2.1", "h264"), ("v3.0", "h264"), ("v3.0", "av1"), ("v2.1", "png")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def written(request, tmp_path_factory):
    version, codec = request.param
    root, episodes = write_synthetic_dataset(tmp_path_factory.mktemp(f"lerobot-{version}-{codec}"),
                                             version=version, codec=codec)
    dataset = LeRobotDataset(root, action_horizon=HORIZON)
    items = [dataset[i] for i in range(len(dataset))]
    return version, root, episodes, dataset, items


def _frame_positions():
    """(global row, episode, frame) for every frame of the tiny dataset."""
    starts = np.cumsum((0, *TINY_LENGTHS[:-1]))
    return [(start + t, e, t) for e, (start, n) in enumerate(zip(starts, TINY_LENGTHS, strict=True)) for t in range(n)]


def test_layout_is_lerobots(written):
    version, root, _, dataset, _ = written
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == version
    assert info["total_episodes"] == 3 and info["total_frames"] == sum(TINY_LENGTHS) and info["fps"] == FPS
    assert info["features"][CAM]["shape"] == [16, 16, 3]
    if info["features"][CAM]["dtype"] == "image":
        assert info["video_path"] is None and not (root / "videos").exists()
        cell = pq.read_table(root / "data/chunk-000/episode_000000.parquet").column(CAM)[0].as_py()
        assert cell["bytes"].startswith(b"\x89PNG")
    elif version == "v2.1":
        assert info["data_path"] == "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        assert (root / "meta/episodes.jsonl").is_file() and (root / "meta/episodes_stats.jsonl").is_file()
        assert (root / f"videos/chunk-000/{CAM}/episode_000002.mp4").is_file()
    else:
        assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
        table = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
        assert table["dataset_from_index"] == [0, 12, 27] and table["dataset_to_index"] == [12, 27, 37]
        assert table["data/file_index"] == [0, 0, 1]
        assert table[f"videos/{CAM}/from_timestamp"] == [0.0, 1.2, 0.0]  # episode 1 starts 12 frames into file 0
        assert table["tasks"] == [["pick up the red cube"], ["open the drawer"], ["pick up the red cube"]]
        tasks = pq.read_table(root / "meta/tasks.parquet")
        assert tasks.column("task").to_pylist() == ["pick up the red cube", "open the drawer"]
        assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    assert dataset.num_episodes == 3 and len(dataset) == sum(TINY_LENGTHS)


def test_states_actions_and_tasks_exact(written):
    _, _, episodes, _, items = written
    for row, e, t in _frame_positions():
        item = items[row]
        np.testing.assert_array_equal(item["observation.state"], episodes[e].features["observation.state"][t])
        assert item["episode_index"] == e and item["frame_index"] == t and item["index"] == row
        assert item["timestamp"] == np.float32(t / FPS)
        assert item["task"] == episodes[e].task


def test_decoded_frames_close_to_originals(written):
    """Lossy codec, so: every frame within 4/255 mean abs error (measured max 3.0/255 with crf 10; the RGB ->
    YUV 4:2:0 conversion alone costs ~2.3/255 on these gradients) and closer to its own original than to any
    other frame of the episode (neighbours differ by >= 7.8/255), which pins the timestamp lookup."""
    _, root, episodes, _, items = written
    errors = []
    for row, e, t in _frame_positions():
        decoded = items[row][CAM]
        assert decoded.shape == (3, 16, 16) and decoded.dtype == np.float32
        originals = episodes[e].cameras[CAM].transpose(0, 3, 1, 2) / 255.0
        distances = np.abs(originals - decoded).mean(axis=(1, 2, 3))
        assert distances.argmin() == t, (row, e, t)
        errors.append(distances[t])
    assert max(errors) < 4 / 255 and np.mean(errors) < 3 / 255
    if json.loads((root / "meta/info.json").read_text())["features"][CAM]["dtype"] == "image":
        assert max(errors) < 1e-7  # PNG is lossless


def test_action_chunks_pad_by_repeating_the_last_action(written):
    _, _, episodes, _, items = written
    for row, e, t in _frame_positions():
        actions = episodes[e].features["action"]
        steps = np.arange(t, t + HORIZON)
        expected_pad = steps >= len(actions)
        np.testing.assert_array_equal(items[row]["action"], actions[np.minimum(steps, len(actions) - 1)])
        np.testing.assert_array_equal(items[row]["action_is_pad"], expected_pad)
    last = items[TINY_LENGTHS[0] - 1]  # last frame of episode 0: one real step, then four copies of it
    assert last["action_is_pad"].tolist() == [False, True, True, True, True]
    assert (last["action"] == episodes[0].features["action"][-1]).all()


def test_past_windows_for_states_and_video(written):
    _, root, episodes, _, items = written
    dataset = LeRobotDataset(root, delta_timestamps={"observation.state": [-0.2, -0.1, 0.0], CAM: [-0.1, 0.0]})
    first = dataset[TINY_LENGTHS[0]]  # frame 0 of episode 1: the past is padding (repeats frame 0)
    assert first["observation.state_is_pad"].tolist() == [True, True, False]
    np.testing.assert_array_equal(first["observation.state"], episodes[1].features["observation.state"][[0, 0, 0]])
    assert first[CAM].shape == (2, 3, 16, 16) and first[f"{CAM}_is_pad"].tolist() == [True, False]
    np.testing.assert_array_equal(first[CAM][0], first[CAM][1])
    np.testing.assert_array_equal(first[CAM][1], items[TINY_LENGTHS[0]][CAM])
    row = TINY_LENGTHS[0] + 5  # frame 5 of episode 1: the window is frames 4 and 5, as single-frame reads give them
    later = dataset[row]
    assert later[f"{CAM}_is_pad"].tolist() == [False, False]
    np.testing.assert_array_equal(later[CAM], np.stack([items[row - 1][CAM], items[row][CAM]]))


def test_bad_delta_timestamps_are_rejected(written):
    _, root, _, _, _ = written
    with pytest.raises(ValueError, match="not multiples of 1/fps"):
        LeRobotDataset(root, delta_timestamps={"action": [0.0, 0.05]})
    with pytest.raises(ValueError, match="unknown features"):
        LeRobotDataset(root, delta_timestamps={"actoin": [0.0]})


def test_variable_size_list_columns_and_the_dataset_kind(written):
    """Parquet written by other tools may hold ``list<float>`` instead of fixed-size lists; the ``lerobot``
    dataset kind (what a config's ``data.dataset: lerobot`` builds) reads it alike."""
    version, root, episodes, _, _ = written
    path = root / ("data/chunk-000/episode_000000.parquet" if version == "v2.1" else "data/chunk-000/file-000.parquet")
    table = pq.read_table(path)
    plain = pa.array(table.column("action").to_pylist(), type=pa.list_(pa.float32()))
    original = path.read_bytes()
    try:
        pq.write_table(table.set_column(table.column_names.index("action"), "action", plain), path)
        dataset = lerobot_dataset([root], None, action_horizon=2)
        np.testing.assert_array_equal(dataset[0]["action"], episodes[0].features["action"][:2])
    finally:
        path.write_bytes(original)


def test_episode_subset_in_the_order_asked(written):
    _, root, episodes, _, items = written
    subset = LeRobotDataset(root, action_horizon=HORIZON, episodes=[2, 0])
    assert len(subset) == TINY_LENGTHS[2] + TINY_LENGTHS[0]
    first_of_2, first_of_0 = subset[0], subset[TINY_LENGTHS[2]]
    assert (first_of_2["episode_index"], first_of_2["frame_index"]) == (2, 0)
    assert (first_of_0["episode_index"], first_of_0["frame_index"]) == (0, 0)
    last_of_2 = subset[TINY_LENGTHS[2] - 1]
    np.testing.assert_array_equal(last_of_2["action"], items[sum(TINY_LENGTHS) - 1]["action"])
    assert last_of_2["action_is_pad"].tolist() == [False, True, True, True, True]
    with pytest.raises(IndexError):
        subset[len(subset)]
    with pytest.raises(ValueError, match=r"episodes \[7\] are not in"):
        LeRobotDataset(root, episodes=[0, 7])
