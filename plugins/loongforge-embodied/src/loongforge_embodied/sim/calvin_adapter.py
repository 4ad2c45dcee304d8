"""CALVIN tasks through the environment interface: ``calvin:<subtask>``, e.g. ``calvin:open_drawer``.

The simulator is CALVIN's ``PlayTableSimEnv`` on PyBullet, built as CALVIN's evaluation builds it:
``calvin_env.envs.play_table_env.get_env(dataset_dir, show_gui=False)`` reads the render and scene settings of a
CALVIN dataset split (``$CALVIN_DATASET``, e.g. ``task_D_D/validation``). Success is CALVIN's task oracle, configured
from ``calvin_models/conf`` of the CALVIN checkout (``$CALVIN_CONF``; by default the one beside the installed
``calvin_env``): ``Tasks(callbacks/rollout/tasks/new_playtable_tasks.yaml).get_task_info_for_set(start_info,
env.get_info(), {subtask})`` holds the subtask, ``start_info`` being the info right after the reset.

Seeds: seed ``k`` starts from the robot and scene state of the dataset's ``k``-th ``episode_*.npz`` frame (sorted
by name; ``env.reset(robot_obs=..., scene_obs=...)``), so initial states are real ones from the recordings.

Observation: ``state`` is CALVIN's ``robot_obs`` (15: tool position and Euler angles, gripper width, 7 joints,
gripper action); cameras ``static`` and ``gripper`` are ``rgb_obs["rgb_static"]`` and ``rgb_obs["rgb_gripper"]``.
Actions: CALVIN's 7 relative values in [-1, 1] (position, Euler angles, gripper), the gripper sent as -1 or +1 as the
robot expects. The instruction is the subtask's first validation annotation
(``annotations/new_playtable_validation.yaml``, e.g. "pull the handle to open the drawer").

Not on the package registry: ``calvin_env`` installs from its repository (PyBullet itself is on PyPI) and needs a
CALVIN dataset split for its configuration; the adapter is tested against a fake with CALVIN's names
(tests/fakes/calvin_env).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from loongforge_embodied.sim.environment import (
    Observation,
    SimEnvironmentError,
    check_cameras,
    clip_action,
    missing_package,
    spec_of,
)

CAMERAS = ("static", "gripper")
#: CALVIN's evaluation gives each subtask 360 steps at 30 Hz.
MAX_STEPS = 360
CONTROL_FREQ = 30
DATASET_ENV = "CALVIN_DATASET"
CONF_ENV = "CALVIN_CONF"
#: calvin_env is not on the package registry.
INSTALL = "install calvin_env from the CALVIN repository (pip install -e calvin_env in its checkout)"
#: CALVIN's task definitions and instructions, relative to ``calvin_models/conf``.
TASKS_CONFIG = Path("callbacks/rollout/tasks/new_playtable_tasks.yaml")
ANNOTATIONS = Path("annotations/new_playtable_validation.yaml")


def _calvin() -> tuple[Any, Any, Path]:
    """``get_env``, the ``Tasks`` oracle class and ``calvin_models/conf`` (``$CALVIN_CONF``, else the CALVIN
    checkout's: calvin_env is its submodule, ``<checkout>/calvin_env/calvin_env``)."""
    try:
        import calvin_env
        from calvin_env.envs.play_table_env import get_env
        from calvin_env.envs.tasks import Tasks
    except ImportError as err:
        raise missing_package("CALVIN (calvin_env)", INSTALL, err) from err
    default = Path(calvin_env.__file__).resolve().parents[2] / "calvin_models" / "conf"
    return get_env, Tasks, Path(os.environ.get(CONF_ENV) or default)


class CalvinEnv:
    """One CALVIN subtask; :meth:`reset` with a seed starts from that recorded state (module docstring)."""

    action_dim = 7
    video_camera = "static"
    robot_type = "franka"

    def __init__(self, name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> None:
        self.subtask = spec_of(name, "calvin")
        self.name, self.image_size = name, image_size
        self.cameras = check_cameras(cameras, CAMERAS, "CALVIN")
        self._get_env, tasks_class, conf = _calvin()
        self.dataset = Path(os.environ.get(DATASET_ENV, ""))
        if not os.environ.get(DATASET_ENV) or not (self.dataset / ".hydra").is_dir():
            raise SimEnvironmentError(f"CALVIN needs a dataset split for its settings: set {DATASET_ENV} to a "
                                      f"directory with .hydra/ and episode_*.npz (now {str(self.dataset)!r})")
        if not (conf / TASKS_CONFIG).is_file():
            raise SimEnvironmentError(f"no CALVIN task definitions at {conf / TASKS_CONFIG}: set {CONF_ENV} to the "
                                      "CALVIN checkout's calvin_models/conf")
        self._oracle = tasks_class(yaml.safe_load((conf / TASKS_CONFIG).read_text())["tasks"])
        if self.subtask not in self._oracle.tasks:
            raise SimEnvironmentError(f"unknown CALVIN subtask '{self.subtask}'; known: "
                                      f"{', '.join(sorted(self._oracle.tasks))}")
        self.task = yaml.safe_load((conf / ANNOTATIONS).read_text())[self.subtask][0]
        self._frames = sorted(self.dataset.glob("episode_*.npz"))
        self._env: Any = None
        self._start_info: dict[str, Any] = {}
        self._last: dict[str, Any] = {}

    @property
    def fps(self) -> int:
        return CONTROL_FREQ

    @property
    def max_steps(self) -> int:
        return MAX_STEPS

    def reset(self, seed: int) -> Observation:
        if not 0 <= seed < len(self._frames):
            raise SimEnvironmentError(f"{self.dataset} holds {len(self._frames)} episode_*.npz frames; seed {seed} "
                                      f"is not one of 0..{len(self._frames) - 1}")
        if self._env is None:
            self._env = self._get_env(str(self.dataset), show_gui=False)
        with np.load(self._frames[seed]) as frame:
            robot_obs, scene_obs = frame["robot_obs"], frame["scene_obs"]
        raw = self._env.reset(robot_obs=robot_obs, scene_obs=scene_obs)
        self._start_info = self._env.get_info()
        return self._observe(raw)

    def step(self, action: np.ndarray) -> tuple[Observation, bool]:
        if self._env is None:
            raise RuntimeError("call reset(seed) before step()")
        command = clip_action(action, self.action_dim, "CALVIN")
        command[6] = 1.0 if command[6] > 0 else -1.0
        raw, reward, _, info = self._env.step(command)
        done = self._oracle.get_task_info_for_set(self._start_info, info, {self.subtask})
        return self._observe(raw, float(reward)), bool(done)

    def _observe(self, raw: dict[str, Any], reward: float = 0.0) -> Observation:
        self._last = raw
        images = {cam: self._image(cam, self.image_size) for cam in self.cameras}
        return Observation(np.asarray(raw["robot_obs"], np.float64).reshape(-1), images, reward)

    def _image(self, camera: str, size: int) -> np.ndarray:
        rgb = np.asarray(self._last["rgb_obs"][f"rgb_{camera}"], np.uint8)
        if rgb.shape[:2] == (size, size):
            return np.ascontiguousarray(rgb)
        return np.asarray(Image.fromarray(rgb).resize((size, size), Image.BILINEAR))

    def render(self, camera: str, size: int) -> np.ndarray:
        """The last observation's ``camera`` image at ``size`` pixels a side (CALVIN renders every step)."""
        check_cameras([camera], CAMERAS, "CALVIN")
        return self._image(camera, size)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env = None
