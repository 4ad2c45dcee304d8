"""SimplerEnv tasks through the environment interface: ``simpler:<task>``, e.g. ``simpler:widowx_carrot_on_plate``.

The simulator is ``simpler_env.make(task)`` (ManiSkill2's real-to-sim environments on SAPIEN, ``obs_mode="rgbd"``).
An episode's seed is both the reset seed and the object layout (``options={"obj_init_options": {"episode_id":
seed}}``, as SimplerEnv's own evaluator picks layouts), so the same seed is the same scene. The instruction is
``get_language_instruction()`` after the reset.

Observation: ``state`` is the robot's joint positions (``obs["agent"]["qpos"]``) followed by its tool pose
(``obs["extra"]["tcp_pose"]``: position and wxyz quaternion); the one camera is the robot's main view as
SimplerEnv's ``get_image_from_maniskill2_obs_dict`` chooses it (``overhead_camera`` for the Google robot,
``3rd_view_camera`` for WidowX), from ``obs["image"][camera]["rgb"]``. Actions: 7 values -- position delta (3),
rotation delta as an axis-angle vector (3), gripper (1); success is ``info["success"]``.

Not on the package registry: SimplerEnv and its ManiSkill2 fork install from their repositories, and SAPIEN
renders through Vulkan, which this CPU machine lacks; the adapter is tested against a fake with SimplerEnv's
names (tests/fakes/simpler_env).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from loongforge_embodied.sim.environment import (
    Observation,
    SimEnvironmentError,
    check_cameras,
    clip_action,
    missing_package,
    spec_of,
)

#: SimplerEnv is not on the package registry.
INSTALL = "install SimplerEnv and its ManiSkill2_real2sim from their repositories (pip install -e in each checkout)"
#: The main camera per robot (the robot uid holds the key), as SimplerEnv's observation helper picks it.
MAIN_CAMERAS = {"google_robot": "overhead_camera", "widowx": "3rd_view_camera"}


def _simpler() -> Any:
    try:
        import simpler_env
    except ImportError as err:
        raise missing_package("SimplerEnv (simpler_env)", INSTALL, err) from err
    return simpler_env


class SimplerEnv:
    """One SimplerEnv task; :meth:`reset` with a seed starts that seed's layout (module docstring)."""

    action_dim = 7

    def __init__(self, name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> None:
        task = spec_of(name, "simpler")
        self._package = _simpler()
        if task not in self._package.ENVIRONMENTS:
            raise SimEnvironmentError(f"unknown SimplerEnv task '{task}'; known: "
                                      f"{', '.join(self._package.ENVIRONMENTS)}")
        robot = next((key for key in MAIN_CAMERAS if task.startswith(key)), None)
        if robot is None:
            raise SimEnvironmentError(f"no main camera known for SimplerEnv task '{task}' (robots: "
                                      f"{sorted(MAIN_CAMERAS)})")
        self.video_camera, self.robot_type = MAIN_CAMERAS[robot], robot
        self.cameras = check_cameras(cameras, [self.video_camera], "SimplerEnv")
        self.name, self.image_size, self._task_name = name, image_size, task
        #: The instruction; SimplerEnv tells it after a reset, until then the task's words.
        self.task = task.replace("_", " ")
        self._env: Any = None
        self._last: dict[str, Any] = {}

    def _simulator(self) -> Any:
        if self._env is None:
            self._env = self._package.make(self._task_name)
        return self._env

    @property
    def fps(self) -> int:
        return int(self._simulator().unwrapped.control_freq)

    @property
    def max_steps(self) -> int:
        return int(self._simulator().spec.max_episode_steps)

    def reset(self, seed: int) -> Observation:
        env = self._simulator()
        raw, _ = env.reset(seed=seed, options={"obj_init_options": {"episode_id": seed}})
        self.task = env.unwrapped.get_language_instruction()
        return self._observe(raw)

    def step(self, action: np.ndarray) -> tuple[Observation, bool]:
        if self._env is None:
            raise RuntimeError("call reset(seed) before step()")
        raw, reward, _, _, info = self._env.step(clip_action(action, self.action_dim, "SimplerEnv"))
        return self._observe(raw, float(reward)), bool(info["success"])

    def _observe(self, raw: dict[str, Any], reward: float = 0.0) -> Observation:
        self._last = raw
        state = np.concatenate([np.asarray(raw["agent"]["qpos"], np.float64).reshape(-1),
                                np.asarray(raw["extra"]["tcp_pose"], np.float64).reshape(-1)])
        images = {cam: self._image(cam, self.image_size) for cam in self.cameras}
        return Observation(state, images, reward)

    def _image(self, camera: str, size: int) -> np.ndarray:
        rgb = np.asarray(self._last["image"][camera]["rgb"], np.uint8)
        if rgb.shape[:2] == (size, size):
            return np.ascontiguousarray(rgb)
        return np.asarray(Image.fromarray(rgb).resize((size, size), Image.BILINEAR))

    def render(self, camera: str, size: int) -> np.ndarray:
        """The last observation's ``camera`` image at ``size`` pixels a side (SAPIEN renders every step)."""
        check_cameras([camera], [self.video_camera], "SimplerEnv")
        return self._image(camera, size)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env = None

