"""Meta-World closed loop: expert episodes recorded as a LeRobotDataset and read back, the policy server's protocol
over a real local websocket, a policy trained a few steps by ``loongforge train`` on the recorded set acting
through the server exactly as in-process, and the random baseline."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from loongforge.cli import main
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.sim.client import PolicyClient, PolicyServerError
from loongforge_embodied.sim.collect import REPORT_PATH, CollectError, collect
from loongforge_embodied.sim.evaluate import chunk_seed, evaluate
from loongforge_embodied.sim.metaworld_env import MetaWorldEnv, expert
from loongforge_embodied.sim.policy import CheckpointPolicy, RandomPolicy, act_each
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
                 "--out", str(out), "--trackers", "csv"]) == 0
    report = json.loads((out / "summary.json").read_text())
    # the totals reach the tracker, at step 0 (no checkpoint)
    with open(out / "metrics.csv", newline="") as handle:
        (logged,) = list(csv.DictReader(handle))
    assert {key: float(value) for key, value in logged.items()} == {
        "step": 0.0, **{f"eval/random/{metric}": float(report["random"][metric])
                        for metric in ("success_rate", "mean_return", "mean_length", "episodes")}}
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
    """In process and through the server, side by side (``batch``) and one at a time: the same episodes."""
    policy = CheckpointPolicy(metaworld_checkpoint, steps=2)
    meta = policy.metadata
    assert (meta["action_dim"], meta["horizon"], meta["state_dim"], meta["cameras"]) == (4, 4, 39, [])
    assert meta["train_step"] == 4  # the trackers log the results at the checkpoint's step
    dataset = LeRobotDataset(metaworld_recorded.root)
    first = dataset[0]
    chunk = policy.act(first["task"], first["observation.state"], seed=5)
    assert chunk.shape == (4, 4) and np.isfinite(chunk).all()
    # a batch of observations, each with its own seed: each chunk is the one it gets alone (float rounding apart)
    frames = [dataset[i] for i in (0, 7, 30)]
    batched = policy.act_batch(first["task"], np.stack([f["observation.state"] for f in frames]), [{}] * 3, [5, 6, 7])
    alone = [policy.act(first["task"], f["observation.state"], seed=s) for f, s in zip(frames, (5, 6, 7), strict=True)]
    np.testing.assert_allclose(batched, np.stack(alone), rtol=0, atol=1e-5)
    assert np.abs(batched[0] - batched[1]).max() > 1e-2  # the seeds (and states) matter
    seeds = [1000, 1001, 1002]
    local = evaluate(policy, ENV, seeds, replan=2, max_steps=10, batch=3)
    serial = evaluate(policy, ENV, seeds, replan=2, max_steps=10, batch=1)
    with serving(policy) as url, PolicyClient(url) as client:
        np.testing.assert_array_equal(client.act(first["task"], first["observation.state"], seed=5), chunk)
        remote = evaluate(client, ENV, seeds, replan=2, max_steps=10, batch=2)
    assert [(e["seed"], e["success"], e["steps"]) for e in local["per_episode"]] == [
        (e["seed"], e["success"], e["steps"]) for e in serial["per_episode"]]
    assert [e["return"] for e in local["per_episode"]] == pytest.approx(
        [e["return"] for e in serial["per_episode"]], rel=1e-6)
    # the server acts on one observation at a time, as the serial evaluation does: bit for bit its episodes
    assert remote["per_episode"] == serial["per_episode"]
    assert all(e["steps"] == 10 or e["success"] for e in local["per_episode"])


class ExpertChunks:
    """Meta-World's scripted expert as a chunking policy: each chunk is the expert's action for the observation
    plus noise drawn from the chunk's seed, so episodes succeed at different steps and every action depends on
    the seed the evaluator hands that episode's chunk."""

    def __init__(self, horizon: int = 4) -> None:
        self.metadata = {**RandomPolicy(horizon=horizon).metadata, "model": "noisy-expert"}
        self.expert = expert(ENV)

    def act(self, task, state, images=None, *, seed=0):
        noise = np.random.default_rng(seed).normal(0.0, 0.5, (self.metadata["horizon"], 4))
        return np.clip(self.expert(np.asarray(state, np.float64)) + noise, -1.0, 1.0)

    def act_batch(self, task, states, images, seeds):
        return act_each(self.act, task, states, images, seeds)


def test_side_by_side_episodes_are_the_serial_episodes():
    """Episodes that end at different steps: a finished one's simulator starts the next seed while the others go
    on, and every episode is still exactly the one it is alone (same actions, so the same success, length and
    return to the last bit)."""
    seeds = [1000, 1001, 1003]  # 1001 succeeds first, so 1003 starts while 1000 goes on (and fails)
    serial = evaluate(ExpertChunks(), ENV, seeds, replan=3, max_steps=60, batch=1)
    batched = evaluate(ExpertChunks(), ENV, seeds, replan=3, max_steps=60, batch=2)
    assert batched["per_episode"] == serial["per_episode"]
    assert (batched["successes"], batched["mean_return"]) == (serial["successes"], serial["mean_return"])
    assert [(row["success"], row["steps"]) for row in serial["per_episode"]] == [(False, 60), (True, 51), (True, 48)]
