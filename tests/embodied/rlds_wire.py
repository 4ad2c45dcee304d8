"""An RLDS writer for the tests that shares nothing with the reader under test: ``tf.train.Example`` bytes encoded by
hand from the protobuf wire format, TFRecord framing with a bit-by-bit CRC-32C, and TFDS's file names and
``dataset_info.json`` spelled out here. A reader that got a field number, the packing, the mask or the shard order
wrong cannot pass by agreeing with itself.

Wire format (https://protobuf.dev/programming-guides/encoding/): a field is ``varint(number << 3 | wire_type)``
then its payload; wire type 2 is ``varint(length) + bytes``. ``tensorflow/core/example/feature.proto``: ``Feature``
has ``bytes_list = 1``, ``float_list = 2``, ``int64_list = 3``, each a message whose ``value`` is field 1 (floats and
int64s packed); ``Features.feature = 1`` is a map (entries: ``key = 1``, ``value = 2``); ``Example.features = 1``.
Also used by parity/lerobot/test_rlds_lerobot_reader.py (LeRobot's own reader on the converted set).
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
from PIL import Image

#: The fractal (RT-1) layout of Open X-Embodiment: the action split in three, the instruction in the observation.
STATE_KEYS = ("steps/observation/base_pose_tool_reached", "steps/observation/gripper_closed")
ACTION_KEYS = ("steps/action/world_vector", "steps/action/rotation_delta", "steps/action/gripper_closedness_action")
STATE_WIDTHS, ACTION_WIDTHS = (1, 1), (3, 3, 1)
IMAGE_KEY, TEXT_KEY = "steps/observation/image", "steps/observation/natural_language_instruction"
TASKS = ("pick the coke can", "open the top drawer")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _feature(values) -> bytes:
    if isinstance(values, list):  # BytesList: one field-1 entry per value
        return _field(1, b"".join(_field(1, v) for v in values))
    array = np.asarray(values).reshape(-1)
    if array.dtype.kind in "biu":  # Int64List, packed varints (values here are >= 0)
        return _field(3, _field(1, b"".join(_varint(int(v)) for v in array)))
    return _field(2, _field(1, array.astype("<f4").tobytes()))  # FloatList, packed little-endian floats


def example_bytes(features: dict) -> bytes:
    entries = b"".join(_field(1, _field(1, key.encode()) + _field(2, _feature(values)))
                       for key, values in features.items())
    return _field(1, entries)


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C one bit at a time (reflected, polynomial 0x82F63B78), no table."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c_bitwise(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_bytes(records: list[bytes]) -> bytes:
    out = bytearray()
    for data in records:
        length = struct.pack("<Q", len(data))
        out += length + struct.pack("<I", _masked(length)) + data + struct.pack("<I", _masked(data))
    return bytes(out)


def png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


def fractal_episodes(lengths=(6, 9, 5), size=12, seed=0) -> list[dict]:
    """Ground truth: per episode the state/action parts, frames (every frame distinct), task and reward."""
    rng = np.random.default_rng(seed)
    episodes = []
    for e, steps in enumerate(lengths):
        frames = rng.integers(0, 256, (steps, size, size, 3), dtype=np.uint8)
        episodes.append({
            "task": TASKS[e % 2], "frames": frames,
            "state": [rng.normal(size=(steps, w)).astype(np.float32) for w in STATE_WIDTHS],
            "action": [rng.normal(size=(steps, w)).astype(np.float32) for w in ACTION_WIDTHS],
            "reward": (np.arange(steps) == steps - 1).astype(np.float32),
        })
    return episodes


def episode_features(ep: dict) -> dict:
    steps = len(ep["frames"])
    first, last = np.arange(steps) == 0, np.arange(steps) == steps - 1
    return {
        "steps/is_first": first.astype(np.int64), "steps/is_last": last.astype(np.int64),
        "steps/is_terminal": last.astype(np.int64), "steps/reward": ep["reward"],
        "steps/discount": np.ones(steps, np.float32),  # a feature no key map names
        IMAGE_KEY: [png(frame) for frame in ep["frames"]], TEXT_KEY: [ep["task"].encode()] * steps,
        **dict(zip(STATE_KEYS, ep["state"], strict=True)), **dict(zip(ACTION_KEYS, ep["action"], strict=True)),
        "episode_metadata/file_path": [b"/robot/episode.npz"],
    }


def write_tfds(root: Path, episodes: list[dict], *, name: str = "fractal_tiny", shards=((0, 1), (2,))) -> Path:
    """``episodes`` as a TFDS directory: shard ``i`` holds the episodes ``shards[i]`` lists, in that order."""
    root.mkdir(parents=True, exist_ok=True)
    for index, members in enumerate(shards):
        path = root / f"{name}-train.tfrecord-{index:05d}-of-{len(shards):05d}"
        path.write_bytes(tfrecord_bytes([example_bytes(episode_features(episodes[e])) for e in members]))
    info = {"name": name, "version": "0.1.0", "splits": [{"name": "train",
                                                          "shardLengths": [str(len(s)) for s in shards]}]}
    (root / "dataset_info.json").write_text(json.dumps(info))
    (root / "features.json").write_text("{}")
    return root
