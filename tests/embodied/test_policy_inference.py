"""Acting with a trained policy after a restart: ``load_task_model`` restores the task's state from the
checkpoint (normaliser, dimensions, cameras, horizon; no dataset rebuilt), its ``act`` reproduces the chunks the
training process sampled, and ``observation_inputs`` of a raw frame (CHW float or HWC uint8 camera) is the
training item of that frame."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from loongforge.config.loader import load_config
from loongforge.train.media import NoMediaLog
from loongforge.train.task_checkpoint import load_task_model
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.policies.flavors import FLAVORS
from loongforge_embodied.train_task import ACTION, NOT_INPUTS, STATE
from test_policy_train import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("infer") / "run"
    train(out, "training.steps=3", "checkpoint.save_at_end=true")
    return out


@pytest.fixture
def one_thread():
    """The training process ran one thread; so does this one, for bit-identical sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_loaded_task_is_ready_to_act(trained, one_thread, tmp_path):
    task, model, path = load_task_model(trained / "checkpoints")
    assert path.name == "step-0000003" and task.train is None  # nothing rebuilt from the data
    assert (task.steps, task.state_dim, task.action_dim, task.action_horizon) == (3, 2, 2, 4)
    assert task.camera_keys == ["observation.images.top"] and task.normalizer.modes[ACTION] == "quantiles"
    state = torch.load(path / "state.pt", weights_only=True)["task"]
    assert isinstance(state["normalizer"]["stats"][STATE]["q01"], list)
    # the held-out evaluation, recomputed from the loaded task: the same sampled chunks give the same numbers
    trained_scores = json.loads((trained / "eval.json").read_text())
    assert task.finish(model, tmp_path, NoMediaLog())["held_out_action_mse"] == trained_scores["held_out_action_mse"]
    assert json.loads((tmp_path / "eval.json").read_text()) == trained_scores


def test_observation_inputs_are_the_training_items(trained):
    task, model, _ = load_task_model(trained / "checkpoints")
    config = load_config(trained / "checkpoints" / "step-0000003" / "config.yaml")
    fresh = FLAVORS[config.model.name].make_task(config)
    items = fresh.build_dataset()
    dataset = LeRobotDataset(task._root(), episodes=[0])
    camera = task.camera_keys[0]
    for index in (0, 5):
        frame = dataset[index]
        expected = {key: value for key, value in items[index].items() if key not in NOT_INPUTS}
        as_float = task.observation_inputs(frame["task"], frame[STATE], {camera: frame[camera]})
        hwc = (frame[camera] * 255).round().astype(np.uint8).transpose(1, 2, 0)
        as_uint8 = task.observation_inputs(frame["task"], frame[STATE].astype(np.float64), {camera: hwc})
        for got in (as_float, as_uint8):
            assert got.keys() == expected.keys() == {"images", "tokens"}
            assert all(torch.equal(got[key], expected[key]) for key in expected)
    batch = {key: torch.stack([task.observation_inputs(dataset[i]["task"], dataset[i][STATE],
                                                       {camera: dataset[i][camera]})[key] for i in (0, 5)])
             for key in ("images", "tokens")}
    chunks = task.act(model, batch, steps=2, seed=7)
    assert chunks.shape == (2, 4, 2) and chunks.dtype == np.float64
    np.testing.assert_array_equal(chunks, fresh.act(model, batch, steps=2, seed=7))  # the task that trained
    assert not np.array_equal(chunks, task.act(model, batch, steps=2, seed=8))
    with pytest.raises(ValueError, match="lack camera"):
        task.observation_inputs(frame["task"], frame[STATE], {})
