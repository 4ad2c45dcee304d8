"""RLDS episodes converted by ``loongforge convert rlds-to-lerobot`` read back through LeRobot 0.4.4's own
``LeRobotDataset`` with the same frames: every state, action, reward, task and camera frame of a TFDS set written by
the independent wire-format writer of tests/embodied/rlds_wire.py (hand-encoded ``tf.train.Example``, bit-by-bit
CRC-32C), so neither our reader nor our writer is the reference. Runs in the lerobot_parity environment (LeRobot is
not installed in the main suite's); tests/embodied/test_rlds.py checks the same set through our own reader."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.rlds import RLDSDataset
from loongforge_embodied.data.rlds_keys import KEY_MAPS
from loongforge_embodied.data.rlds_lerobot import write_lerobot

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "embodied"))
from rlds_wire import fractal_episodes, write_tfds  # noqa: E402


def test_lerobot_reads_the_converted_rlds_frames(tmp_path):
    truth = fractal_episodes()
    source = write_tfds(tmp_path / "fractal_tiny" / "0.1.0", truth)
    out = write_lerobot(tmp_path / "lerobot", RLDSDataset(source, KEY_MAPS["fractal"]), fps=3)
    dataset = LeRobotDataset("local/rlds-converted", root=out)
    rows = [(e, t) for e, want in enumerate(truth) for t in range(len(want["frames"]))]
    assert dataset.num_episodes == 3 and len(dataset) == len(rows) and dataset.fps == 3
    for row, (e, t) in enumerate(rows):
        item, want = dataset[row], truth[e]
        assert (int(item["episode_index"]), int(item["frame_index"]), item["task"]) == (e, t, want["task"])
        np.testing.assert_array_equal(item["observation.state"].numpy(),
                                      np.concatenate([part[t] for part in want["state"]]))
        np.testing.assert_array_equal(item["action"].numpy(), np.concatenate([part[t] for part in want["action"]]))
        assert float(item["next.reward"]) == want["reward"][t]
        frame = np.round(item["observation.images.image"].numpy().transpose(1, 2, 0) * 255).astype(np.uint8)
        np.testing.assert_array_equal(frame, want["frames"][t])
