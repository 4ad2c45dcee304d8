"""RLDS / Open X-Embodiment data without TensorFlow: a TFDS set written by an independent writer (:mod:`rlds_wire`:
hand-encoded protobuf wire format, bit-by-bit CRC) reads back equal through a shipped key map; converted with
``loongforge convert rlds-to-lerobot`` it reads back through our LeRobot v3.0 reader with the same frames (LeRobot's
own reader: parity/lerobot/test_rlds_lerobot_reader.py); a corrupted CRC, a key the map names but the episode lacks
and truncated shards fail in one line naming the file and record; a weighted mixture spec feeds ``loongforge check``
and ``train``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lerobot_faults import RECIPE, run_overrides
from loongforge.cli import main
from loongforge.errors import ConfigError
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.rlds import RLDSDataset
from loongforge_embodied.data.rlds_keys import KEY_MAPS
from loongforge_embodied.data.rlds_mixture import frame_targets, materialise
from loongforge_embodied.data.tfrecord import crc32c, masked_crc32c
from rlds_wire import (
    TEXT_KEY,
    crc32c_bitwise,
    episode_features,
    example_bytes,
    fractal_episodes,
    tfrecord_bytes,
    write_tfds,
)

SHARD_0 = "fractal_tiny-train.tfrecord-00000-of-00002"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    episodes = fractal_episodes()
    return write_tfds(tmp_path_factory.mktemp("rlds") / "fractal_tiny" / "0.1.0", episodes), episodes


def _cli(argv, capsys) -> tuple[int, list[str], str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


def test_crc32c_matches_the_published_check_values():
    # the CRC-32C check value and RFC 3720 (iSCSI) B.4's 32-byte vectors
    assert crc32c(b"123456789") == 0xE3069283
    assert [crc32c(data) for data in (bytes(32), b"\xff" * 32, bytes(range(32)))] == [0x8A9136AA, 0x62A8AB43,
                                                                                      0x46DD794E]
    data = bytes(range(256)) * 3
    assert crc32c(data) == crc32c_bitwise(data)
    assert masked_crc32c(b"") == 0xA282EAD8  # CRC of nothing is 0: the mask's constant alone


def test_written_rlds_reads_back_equal(written):
    root, truth = written
    dataset = RLDSDataset(root, KEY_MAPS["fractal"])
    assert len(dataset) == 3 and dataset.name == "fractal_tiny"
    episodes = list(dataset)
    assert [ep.length for ep in episodes] == [6, 9, 5]
    for ep, want in zip(episodes, truth, strict=True):
        assert ep.instruction == want["task"]
        np.testing.assert_array_equal(ep.state, np.concatenate(want["state"], axis=1))   # base_pose, gripper_closed
        np.testing.assert_array_equal(ep.action, np.concatenate(want["action"], axis=1))  # world, rotation, gripper
        np.testing.assert_array_equal(ep.cameras["observation.images.image"], want["frames"])
        np.testing.assert_array_equal(ep.reward, want["reward"])
        assert ep.is_first.tolist() == [True] + [False] * (ep.length - 1) and ep.is_last[-1] and ep.is_terminal[-1]


def test_converted_to_lerobot_reads_back_the_same_frames(written, tmp_path, capsys):
    root, truth = written
    out = tmp_path / "lerobot"
    code, err, printed = _cli(["convert", "rlds-to-lerobot", str(root), str(out), "--keys", "fractal", "--fps", "3"],
                              capsys)
    assert code == 0, err
    assert printed.strip() == f"converted 3 episodes (20 frames) of RLDS 'fractal_tiny' to LeRobot v3.0 at {out}"
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 3
    dataset = LeRobotDataset(out)
    rows = [(e, t) for e, want in enumerate(truth) for t in range(len(want["frames"]))]
    assert len(dataset) == len(rows)
    for row, (e, t) in enumerate(rows):
        item, want = dataset[row], truth[e]
        assert (item["episode_index"], item["frame_index"], item["task"]) == (e, t, want["task"])
        np.testing.assert_array_equal(item["observation.state"], np.concatenate([p[t] for p in want["state"]]))
        np.testing.assert_array_equal(item["action"], np.concatenate([p[t] for p in want["action"]]))
        assert item["next.reward"] == want["reward"][t]
        frame = np.round(item["observation.images.image"].transpose(1, 2, 0) * 255).astype(np.uint8)
        np.testing.assert_array_equal(frame, want["frames"][t])  # PNG cells: lossless


def _flip_byte(path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def _second_record_offset(path) -> int:
    first_length = int.from_bytes(path.read_bytes()[:8], "little")
    return 8 + 4 + first_length + 4


@pytest.mark.parametrize("fault", ["data crc", "length crc", "cut inside a record", "cut at a record boundary",
                                   "key missing"])
def test_faults_fail_in_one_line_naming_file_and_record(fault, tmp_path, capsys):
    root = write_tfds(tmp_path / "src", fractal_episodes())
    shard = root / SHARD_0
    second = _second_record_offset(shard)
    keys = "fractal"
    if fault == "data crc":  # a bit flipped in the second record's data (its last image byte region)
        _flip_byte(shard, 40)
        expected = f"{shard}: record 1 (byte {second}): the data's CRC does not match (corrupted file)"
    elif fault == "length crc":
        data = bytearray(shard.read_bytes())
        data[second] ^= 0x01  # the second record's length
        shard.write_bytes(bytes(data))
        expected = f"{shard}: record 1 (byte {second}): the length's CRC does not match (corrupted file)"
    elif fault == "cut inside a record":
        shard.write_bytes(shard.read_bytes()[:second + 100])
        expected = f"{shard}: record 1 (byte {second}): the file ends inside the record's"
    elif fault == "cut at a record boundary":  # the framing is intact: only dataset_info.json's count tells
        shard.write_bytes(shard.read_bytes()[:second])
        expected = f"{shard}: holds 1 episode(s), dataset_info.json says 2 (truncated or replaced shard?)"
    else:  # bridge's map names steps/observation/image_0, which a fractal episode lacks
        keys = "bridge"
        expected = f"{shard}: episode 0: key 'steps/observation/image_0' named by the key map is missing"
    code, err, _ = _cli(["convert", "rlds-to-lerobot", str(root), str(tmp_path / "out"), "--keys", keys], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and expected in err[0], err[0]


def test_steps_out_of_order_are_refused(tmp_path):
    episodes = fractal_episodes(lengths=(4,))
    root = write_tfds(tmp_path / "src", episodes, shards=((0,),))
    shard = next(root.glob("*.tfrecord-*"))
    features = episode_features(episodes[0])
    features["steps/is_first"] = features["steps/is_first"][::-1].copy()  # steps recorded last-first
    shard.write_bytes(tfrecord_bytes([example_bytes(features)]))
    with pytest.raises(ValueError, match=r"episode 0: 'steps/is_first' is set at steps \[3\], expected only step 0"):
        list(RLDSDataset(root, KEY_MAPS["fractal"]))


def test_the_first_steps_instruction_is_the_task(tmp_path):
    """Some sets change or blank the text on later steps; the episode's task is what step 0 says."""
    episodes = fractal_episodes(lengths=(3,))
    root = write_tfds(tmp_path / "src", episodes, shards=((0,),))
    features = episode_features(episodes[0])
    features[TEXT_KEY] = [b"stack the cups", b"", b"done"]
    next(root.glob("*.tfrecord-*")).write_bytes(tfrecord_bytes([example_bytes(features)]))
    assert [ep.instruction for ep in RLDSDataset(root, KEY_MAPS["fractal"])] == ["stack the cups"]


def test_mixture_weights_share_the_frames_and_feed_check_and_train(tmp_path, capsys):
    """Two sources told apart by their task texts: the synthetic set (12 + 15 + 10 steps) and the fractal set read
    through an inline map whose widths and camera match it (4 state, 3 action dims, 16x16 frames; 6 + 9 + 5 steps),
    weighted 3:1."""
    assert main(["make-data", "synthetic-rlds", str(tmp_path / "synthetic")]) == 0
    fractal = fractal_episodes(size=16)
    write_tfds(tmp_path / "fractal", fractal)
    inline = {"state": ["steps/action/world_vector", "steps/observation/gripper_closed"],
              "action": ["steps/action/rotation_delta"],
              "instruction": "steps/observation/natural_language_instruction"}
    spec = tmp_path / "mixture.yaml"
    spec.write_text(json.dumps({"datasets": [{"path": "synthetic", "weight": 3.0},
                                             {"path": "fractal", "keys": inline, "weight": 1.0}], "seed": 1, "fps": 5}))
    assert frame_targets([37, 20], [3.0, 1.0]) == [42.75, 14.25]  # all 57 frames shared out 3:1
    mixed = LeRobotDataset(materialise(spec, tmp_path / "data"))
    frames = [mixed[i] for i in range(len(mixed))]
    from_fractal = [f for f in frames if f["task"] in {ep["task"] for ep in fractal}]
    # whole episodes: each share is met to within half of its dataset's longest episode
    assert abs(len(frames) - len(from_fractal) - 42.75) <= 7.5 and abs(len(from_fractal) - 14.25) <= 4.5
    rows = {tuple(ep["action"][1][t]) for ep in fractal for t in range(len(ep["frames"]))}
    assert from_fractal and all(tuple(f["action"]) in rows for f in from_fractal)  # rotation_delta, as recorded
    assert mixed.fps == 5 and materialise(spec, tmp_path / "data") == mixed.root  # written once, reused
    overrides = [*run_overrides(spec, tmp_path / "run"), "training.micro_batch_size=4"]
    code, err, out = _cli(["check", RECIPE, *overrides], capsys)
    assert code == 0, err
    assert f"task.data: {tmp_path / 'run' / 'data'}/rlds-mixture-mixture-" in out
    code, err, _ = _cli(["train", RECIPE, *overrides], capsys)
    assert code == 0, err


def test_mixture_of_different_widths_is_refused_in_one_line(written, tmp_path):
    root, _ = written
    assert main(["make-data", "synthetic-rlds", str(tmp_path / "synthetic")]) == 0
    spec = tmp_path / "mixture.yaml"
    spec.write_text(json.dumps({"datasets": [{"path": "synthetic"}, {"path": str(root), "keys": "fractal"}]}))
    with pytest.raises(ConfigError, match=r"episode \d+ has features .*'observation.state': \(2,\).*episode 0 has "
                                          r".*'observation.state': \(4,\)"):
        materialise(spec, tmp_path / "data")
