"""FAKE ``calvin_env.envs.play_table_env``: ``get_env(dataset_path, show_gui=...)`` -> an environment with
CALVIN's ``reset(robot_obs=, scene_obs=)``, ``step(action)`` -> ``(obs, 0, False, info)``, ``get_info()`` and
``close()``; observations ``{"rgb_obs": {"rgb_static", "rgb_gripper"}, "depth_obs": {...}, "robot_obs" (15),
"scene_obs" (24)}`` (CALVIN's ``calvin_env/envs/play_table_env.py``).

Physics: a relative action moves the tool (``robot_obs[:3]``) 2 cm per unit; ``scene_obs[0]`` is the sliding door's
joint, dragged along x while the gripper is closed (action[6] == 1). The fake refuses gripper commands other than
-1 and 1, as CALVIN's robot does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class PlayTableSimEnv:
    def __init__(self, dataset_path: str) -> None:
        assert (Path(dataset_path) / ".hydra" / "merged_config.yaml").is_file(), dataset_path
        self.robot_obs, self.scene_obs = np.zeros(15), np.zeros(24)
        self.closed = False

    def reset(self, robot_obs: np.ndarray | None = None, scene_obs: np.ndarray | None = None) -> dict[str, Any]:
        self.robot_obs = np.array(robot_obs, np.float64)
        self.scene_obs = np.array(scene_obs, np.float64)
        return self.get_obs()

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], int, bool, dict[str, Any]]:
        action = np.asarray(action, np.float64)
        assert action.shape == (7,) and action[6] in (-1.0, 1.0), action
        self.robot_obs[:3] += action[:3] * 0.02
        self.robot_obs[14] = action[6]
        if action[6] == 1.0:
            self.scene_obs[0] += action[0] * 0.02
        return self.get_obs(), 0, False, self.get_info()

    def get_obs(self) -> dict[str, Any]:
        static = np.full((200, 200, 3), 10, np.uint8)
        gripper = np.full((84, 84, 3), 200, np.uint8)
        return {"rgb_obs": {"rgb_static": static, "rgb_gripper": gripper},
                "depth_obs": {"depth_static": np.zeros((200, 200)), "depth_gripper": np.zeros((84, 84))},
                "robot_obs": self.robot_obs.copy(), "scene_obs": self.scene_obs.copy()}

    def get_info(self) -> dict[str, Any]:
        return {"robot_info": {"uid": 1}, "scene_info": {"doors": {"base__slide": {"current_state":
                                                                                      float(self.scene_obs[0])}}}}

    def close(self) -> None:
        self.closed = True


def get_env(dataset_path: str, obs_space: Any = None, show_gui: bool = True, **kwargs: Any) -> PlayTableSimEnv:
    assert not show_gui, "no display here"
    return PlayTableSimEnv(dataset_path)
