"""A broken LeRobotDataset fails when opened (or read) with one line naming the file and the episode: through the
reader, and through ``loongforge check`` and ``loongforge train`` on the embodied recipe (every fault of
:mod:`lerobot_faults`), never as a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from lerobot_faults import FAULTS, RECIPE, run_overrides
from loongforge.cli import main
from loongforge.errors import LoongForgeError
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


# -- every fault of lerobot_faults, through each entry point ---------------------------------------------------------
def test_the_faults_are_distinct_and_many():
    assert len(FAULTS) >= 25
    assert len({f.name for f in FAULTS}) == len(FAULTS)


def test_a_format_error_is_one_the_cli_prints_as_one_line():
    assert issubclass(LeRobotFormatError, LoongForgeError) and issubclass(LeRobotFormatError, ValueError)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_the_reader_names_the_fault(fault, tmp_path):
    root = fault.make(tmp_path)
    with pytest.raises(LeRobotFormatError) as caught:
        LeRobotDataset(root).check_videos()
    message = str(caught.value)
    assert "\n" not in message and fault.expected in message and str(root) in message


def test_check_videos_opens_every_file_or_a_spread_sample(pristine, tmp_path):
    root = shutil.copytree(pristine["v2.1"], tmp_path / "dataset")
    assert LeRobotDataset(root).check_videos() == (3, 3)
    middle = root / f"videos/chunk-000/{CAM}/episode_000001.mp4"
    middle.write_bytes(bytes(middle.stat().st_size))
    dataset = LeRobotDataset(root)
    assert dataset.check_videos(max_files=2) == (2, 3)  # episodes 0 and 2: the zeroed file in between is not opened
    with pytest.raises(LeRobotFormatError, match="episode_000001.mp4: episode 1 .*not a readable video"):
        dataset[12]  # ... and fails, in one line, when read
    with pytest.raises(LeRobotFormatError, match="episode_000001.mp4: episode 1"):
        dataset.check_videos()


def _cli(argv, capsys) -> tuple[int, list[str], str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


def test_check_and_train_accept_the_pristine_dataset(tmp_path, capsys):
    root, _ = write_synthetic_dataset(tmp_path / "dataset", version="v3.0")
    code, err, out = _cli(["check", RECIPE, *run_overrides(root, tmp_path / "run")], capsys)
    assert code == 0, err
    assert (f"task.data: {root}: LeRobot v3.0, 3 episodes, 37 frames at 10 fps, cameras ['{CAM}']; 2 of 2 video "
            "file(s) opened") in out
    code, err, out = _cli(["train", RECIPE, *run_overrides(root, tmp_path / "run")], capsys)
    assert code == 0, err
    assert (tmp_path / "run/checkpoints/step-0000001/model.safetensors").is_file()


@pytest.mark.parametrize("command", ["check", "train"])
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_check_and_train_refuse_the_fault_in_one_line(fault, command, tmp_path, capsys):
    root = fault.make(tmp_path)
    code, err, out = _cli([command, RECIPE, *run_overrides(root, tmp_path / "run")], capsys)
    assert code == 2, out
    assert len(err) == 1 and err[0].startswith("error: ") and fault.expected in err[0], err
    assert not list(tmp_path.glob("run/checkpoints/step-*"))  # nothing trained


def test_the_commands_as_processes_print_one_line(tmp_path):
    """What a user sees: ``loongforge check`` / ``train`` on a dataset with a corrupt video, exit 2, no traceback."""
    fault = next(f for f in FAULTS if f.name == "corrupt-video")
    root = fault.make(tmp_path)
    for command in ("check", "train"):
        done = subprocess.run([sys.executable, "-m", "loongforge.cli", command, RECIPE,
                               *run_overrides(root, tmp_path / "run")], capture_output=True, text=True, timeout=300)
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(errors) == 1 and fault.expected in errors[0], done.stderr
        assert "Traceback" not in done.stderr + done.stdout
