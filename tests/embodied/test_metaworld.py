"""Meta-World closed loop: expert episodes recorded as a LeRobotDataset and read back, the policy server's protocol
over a real local websocket, a policy trained a few steps by ``loongforge train`` on the recorded set acting
through the server exactly as in-process, and the random baseline."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loongforge.cli import main
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.sim.client import PolicyClient, PolicyServerError
from loongforge_embodied.sim.collect import REPORT_PATH, CollectError, collect
from loongforge_embodied.sim.evaluate import chunk_seed, evaluate
from loongforge_embodied.sim.metaworld_env import MetaWorldEnv
from loongforge_embodied.sim.policy import CheckpointPolicy, RandomPolicy
from loongforge_embodied.sim.protocol import pack, unpack
from policy_serving import serving
from websockets.sync.client import connect

ENV = "reach-v3"
def test_expert_episodes_read_back_and_replay(metaworld_recorded):
    """Each written episode is its seed's expert run cut ``tail`` steps after success; replaying its actions from
    the same seed succeeds at the same step (so episodes are a function of the seed)."""
    root, report, tail = metaworld_recorded.root, metaworld_recorded.report, metaworld_recorded.tail
    assert report.seeds == [0, 1] and report.failed_seeds == [] and report.expert_success_rate == 1.0
    dataset = LeRobotDataset(root, action_horizon=4)
    assert dataset.fps == 80 and dataset.num_episodes == 2 and dataset.camera_keys == []
    assert [ep.length for ep in dataset.episodes] == report.lengths == [s + tail + 1 for s in report.success_steps]
    assert json.loads((root / REPORT_PATH).read_text())["seeds"] == [0, 1]
    env = MetaWorldEnv(ENV)
    for ep, seed, success_step in zip(dataset.episodes, report.seeds, report.success_steps, strict=True):
        frames = [dataset[i] for i in range(ep.start, ep.start + ep.length)]
        assert {f["task"] for f in frames} == {"reach the goal"}
        states = np.stack([f["observation.state"] for f in frames])
        actions = np.stack([f["action"][0] for f in frames])
        assert states.shape == (ep.length, 39) and states.dtype == np.float32 and actions.shape == (ep.length, 4)
        assert np.abs(actions).max() <= 1.0
        observation = env.reset(seed)
        np.testing.assert_array_equal(observation.state.astype(np.float32), states[0])
        solved = []
        for t, action in enumerate(actions):
            np.testing.assert_array_equal(observation.state.astype(np.float32), states[t])
            observation, success = env.step(action)
            solved.append(success)
        assert solved.index(True) == success_step
    goals = [dataset[ep.start]["observation.state"][-3:] for ep in dataset.episodes]  # the last 3 values
    assert np.abs(goals[0] - goals[1]).max() > 0.01


def test_failed_expert_episodes_are_counted(tmp_path):
    with pytest.raises(CollectError, match="only 0 of 2 expert episodes of reach-v3 succeeded within 3 steps"):
        collect(tmp_path / "none", ENV, episodes=1, max_steps=3, max_attempts=2)
    assert not (tmp_path / "none").exists()


def test_protocol_keeps_arrays_exact():
    arrays = {"state": np.linspace(-1, 1, 39), "image": np.arange(48, dtype=np.uint8).reshape(4, 4, 3),
              "chw": np.full((3, 2, 2), 0.25, np.float32)}
    back = unpack(pack({"task": "t", **arrays, "seed": np.int64(3)}))
    assert back["task"] == "t" and back["seed"] == 3
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value)
    with pytest.raises(ValueError, match="not a valid msgpack"):
        unpack(b"\xc1")
    with pytest.raises(ValueError, match="got text"):
        unpack("{}")


def test_server_answers_like_the_policy_and_reports_errors():
    policy = RandomPolicy(horizon=6, state_dim=39)
    state = np.linspace(0, 1, 39)
    with serving(policy) as url, PolicyClient(url) as client:  # the limits: 8 x a float64 state + 64 KiB, 4 clients
        assert client.metadata == {**policy.metadata, "limits": {
            "max_message_bytes": 8 * 8 * 39 + 64 * 1024, "max_connections": 4, "max_connections_per_client": 4,
            "idle_timeout_s": 120.0}}
        chunk = client.act("reach the goal", state, seed=7)
        assert chunk.shape == (6, 4)
        np.testing.assert_array_equal(chunk, policy.act("reach the goal", state, seed=7))
        with pytest.raises(PolicyServerError, match="'state' has shape \\[3\\]; the policy takes a vector of 39"):
            client.act("reach the goal", np.zeros(3))
        with connect(url) as raw:  # hand-written requests: each wrong one gets an error, the connection stays open
            assert unpack(raw.recv())["horizon"] == 6
            for request, error in [("{}", "got text"), (pack({"state": [0.0] * 39}), "'task' must be"),
                                   (pack({"task": "x", "state": [0.0] * 39, "cam": 1}), "unknown request keys"),
                                   (pack({"task": "x", "state": {"__ndarray__": True, "dtype": "<f8", "shape": [5],
                                                                 "data": b"12"}}), "bad __ndarray__")]:
                raw.send(request)
                assert error in unpack(raw.recv())["error"]
            raw.send(pack({"task": "x", "state": state.tolist(), "seed": 7}))
            np.testing.assert_array_equal(unpack(raw.recv())["actions"], chunk)


def test_random_baseline_command(tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "random", "--seeds", "2", "--first-seed", "1000", "--max-steps", "6", "--replan", "4",
                 "--out", str(out)]) == 0
    report = json.loads((out / "summary.json").read_text())
    assert set(report) == {"random"}
    assert report["random"]["seeds"] == [1000, 1001] and report["random"]["success_rate"] == 0.0
    assert report["random"]["episodes"] == 2 and report["random"]["mean_length"] == 6.0
    assert [e["steps"] for e in report["random"]["per_episode"]] == [6, 6]
    assert not (out / "videos").exists()  # no --videos: nothing rendered


def test_random_baseline_through_server_equals_in_process():
    policy = RandomPolicy(horizon=5)
    local = evaluate(policy, ENV, [1000], replan=3, max_steps=12)
    with serving(policy) as url, PolicyClient(url) as client:
        remote = evaluate(client, ENV, [1000], replan=3, max_steps=12)
    assert local["per_episode"] == remote["per_episode"]
    assert [(e["seed"], e["success"], e["steps"]) for e in local["per_episode"]] == [(1000, False, 12)]
    assert local["mean_return"] == local["per_episode"][0]["return"] > 0  # reach's shaped reward is positive
    assert local["success_rate"] == 0.0
    assert chunk_seed(0, 1000, 3) != chunk_seed(0, 1000, 6) != chunk_seed(1, 1000, 3)


def test_policy_through_server_equals_in_process(metaworld_checkpoint, metaworld_recorded):
    policy = CheckpointPolicy(metaworld_checkpoint, steps=2)
    meta = policy.metadata
    assert (meta["action_dim"], meta["horizon"], meta["state_dim"], meta["cameras"]) == (4, 4, 39, [])
    first = LeRobotDataset(metaworld_recorded.root)[0]
    chunk = policy.act(first["task"], first["observation.state"], seed=5)
    assert chunk.shape == (4, 4) and np.isfinite(chunk).all()
    local = evaluate(policy, ENV, [1000, 1001], replan=2, max_steps=10)
    with serving(policy) as url, PolicyClient(url) as client:
        np.testing.assert_array_equal(client.act(first["task"], first["observation.state"], seed=5), chunk)
        remote = evaluate(client, ENV, [1000, 1001], replan=2, max_steps=10)
    assert local["per_episode"] == remote["per_episode"]
    assert all(e["steps"] == 10 or e["success"] for e in local["per_episode"])
