"""FAKE ``libero.libero.envs.OffScreenRenderEnv`` (LIBERO's ``libero/libero/envs/env_wrapper.py``): the constructor
keywords, ``obj_of_interest``, ``seed``, ``reset``, ``set_init_state``, ``step`` -> ``(obs, reward, done, info)``,
``check_success``, ``sim.render(camera_name=, width=, height=)`` and ``close``, with robosuite's observation keys
(``robot0_eef_pos``, ``robot0_eef_quat`` as x, y, z, w, ``robot0_gripper_qpos``, ``<object>_pos``,
``<camera>_image`` rendered bottom row first).

The physics is a point: OSC_POSE position actions move the end effector 5 cm per unit; a gripper closed within 2 cm
of the item carries it; an item let go above the basket lands in it, which is success. Images are a gradient whose
first rendered row is bright, so an adapter that forgets to turn them shows a bright bottom row."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

CAMERAS = ("agentview", "robot0_eye_in_hand")
#: Metres one unit of position action moves the end effector (OSC_POSE's output_max).
STEP_SCALE = 0.05


class _Sim:
    def __init__(self, env: OffScreenRenderEnv) -> None:
        self.env = env

    def render(self, camera_name: str, width: int, height: int) -> np.ndarray:
        assert camera_name in CAMERAS, camera_name
        return self.env.frame(height, width)


class OffScreenRenderEnv:
    def __init__(self, bddl_file_name: str, camera_heights: int = 128, camera_widths: int = 128,
                 camera_names: list[str] | None = None, use_camera_obs: bool = True, control_freq: int = 20,
                 hard_reset: bool = True, **kwargs: Any) -> None:
        assert os.path.exists(bddl_file_name), f"[error] {bddl_file_name} does not exist!"
        self.camera_names = list(camera_names or CAMERAS)
        self.height, self.width, self.use_camera_obs = camera_heights, camera_widths, use_camera_obs
        self.obj_of_interest = ["alphabet_soup_1", "basket_1"]
        self.sim = _Sim(self)
        self.steps = 0
        self.closed = False
        self._state = np.zeros(9)
        self._gripper, self._held = -1.0, False

    def seed(self, seed: int) -> None:
        self.seeded = seed

    def reset(self) -> dict[str, Any]:
        self._gripper, self._held = -1.0, False
        return self._obs()

    def set_init_state(self, init_state: np.ndarray) -> dict[str, Any]:
        self._state = np.array(init_state, np.float64)
        return self._obs()

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        action = np.asarray(action, np.float64)
        assert action.shape == (7,) and np.all(np.abs(action) <= 1.0), action
        self.steps += 1
        eef, item, basket = self._state[:3], self._state[3:6], self._state[6:9]
        eef += action[:3] * STEP_SCALE
        closing = action[6] > 0
        if closing and not self._held and np.linalg.norm(item - eef) < 0.02:
            self._held = True
        if self._held and not closing:
            self._held = False
            if np.linalg.norm(item[:2] - basket[:2]) < 0.05:
                item[:] = basket + [0, 0, 0.02]
        if self._held:
            item[:] = eef - [0, 0, 0.01]
        self._gripper = 1.0 if closing else -1.0
        success = self.check_success()
        return self._obs(), float(success), success, {}

    def check_success(self) -> bool:
        item, basket = self._state[3:6], self._state[6:9]
        return bool(not self._held and np.linalg.norm(item - basket - [0, 0, 0.02]) < 1e-9)

    def frame(self, height: int, width: int) -> np.ndarray:
        rows = np.linspace(255, 0, height, dtype=np.float64)[:, None, None]
        return np.broadcast_to(rows, (height, width, 3)).astype(np.uint8).copy()

    def _obs(self) -> dict[str, Any]:
        opening = 0.0 if self._gripper > 0 else 0.039
        obs = {"robot0_eef_pos": self._state[:3].copy(), "robot0_eef_quat": np.array([1.0, 0.0, 0.0, 0.0]),
               "robot0_gripper_qpos": np.array([opening, -opening]),
               "alphabet_soup_1_pos": self._state[3:6].copy(), "basket_1_pos": self._state[6:9].copy()}
        if self.use_camera_obs:
            for cam in self.camera_names:
                obs[f"{cam}_image"] = self.frame(self.height, self.width)
        return obs

    def close(self) -> None:
        self.closed = True
