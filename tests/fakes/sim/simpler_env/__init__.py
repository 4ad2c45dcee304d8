"""FAKE SimplerEnv (``simpler_env``): ``ENVIRONMENTS`` and ``make(task_name)`` returning a gymnasium-style
environment whose ``unwrapped`` has ``get_language_instruction()``, ``control_freq`` and ``robot_uid``, with
``reset(seed=, options=)`` -> ``(obs, info)`` and ``step(action)`` -> ``(obs, reward, terminated, truncated, info)``
and ManiSkill2's observation keys ``obs["agent"]["qpos"]``, ``obs["extra"]["tcp_pose"]``,
``obs["image"][camera]["rgb"]`` (SimplerEnv's ``simpler_env/__init__.py`` and
``simpler_env/utils/env/observation_utils.py``; ManiSkill2's ``BaseEnv``).

Physics: the tool moves 2 cm per unit of action[:3]; success (``info["success"]``) once it is within 3 cm of the
target, which is placed by ``options["obj_init_options"]["episode_id"]``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

ENVIRONMENTS = ["google_robot_pick_coke_can", "widowx_carrot_on_plate"]
INSTRUCTIONS = {"google_robot_pick_coke_can": "pick coke can", "widowx_carrot_on_plate": "put carrot on plate"}
CAMERAS = {"google_robot": "overhead_camera", "widowx": "3rd_view_camera"}


class _ManiSkillEnv:
    def __init__(self, task_name: str) -> None:
        self.task_name = task_name
        self.robot_uid = "widowx" if task_name.startswith("widowx") else "google_robot_static"
        self.control_freq = 5 if task_name.startswith("widowx") else 3
        self.camera = CAMERAS["widowx" if task_name.startswith("widowx") else "google_robot"]
        self.spec = SimpleNamespace(max_episode_steps=60 if task_name.startswith("widowx") else 80)
        self.reset_calls: list[dict[str, Any]] = []
        self.closed = False
        self.tcp, self.target = np.zeros(3), np.zeros(3)

    @property
    def unwrapped(self) -> _ManiSkillEnv:
        return self

    def get_language_instruction(self) -> str:
        return INSTRUCTIONS[self.task_name]

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.reset_calls.append({"seed": seed, "options": options})
        episode = options["obj_init_options"]["episode_id"]
        self.tcp = np.zeros(3)
        self.target = np.array([0.01 * episode, 0.05, 0.0])
        return self._obs(), {"episode_id": episode}

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]:
        action = np.asarray(action, np.float64)
        assert action.shape == (7,), action
        self.tcp += action[:3] * 0.02
        success = bool(np.linalg.norm(self.tcp - self.target) < 0.03)
        return self._obs(), float(success), success, False, {"success": success}

    def _obs(self) -> dict[str, Any]:
        rgb = np.zeros((96, 128, 3), np.uint8)
        rgb[..., 1] = 120
        qpos = np.arange(8, dtype=np.float64) if self.robot_uid == "widowx" else np.arange(11, dtype=np.float64)
        return {"agent": {"qpos": qpos, "base_pose": np.zeros(7)},
                "extra": {"tcp_pose": np.concatenate([self.tcp, [1.0, 0.0, 0.0, 0.0]])},
                "image": {self.camera: {"rgb": rgb, "depth": np.zeros((96, 128, 1))}}}

    def close(self) -> None:
        self.closed = True


def make(task_name: str) -> _ManiSkillEnv:
    assert task_name in ENVIRONMENTS, f"Task {task_name} is not supported. Environments: \n {ENVIRONMENTS}"
    return _ManiSkillEnv(task_name)
