"""FAKE ``calvin_env.envs.tasks.Tasks``: built from the ``tasks`` mapping of CALVIN's task config (name -> [function
name, arguments...]), answering ``get_task_info_for_set(start_info, end_info, task_filter)`` with the achieved
subset (CALVIN's ``calvin_env/envs/tasks.py``). Only ``move_door_rel`` is implemented, as CALVIN defines it."""

from __future__ import annotations

from functools import partial
from typing import Any


class Tasks:
    def __init__(self, tasks: dict[str, list[Any]]) -> None:
        self.tasks = {name: partial(getattr(self, args[0]), *args[1:]) for name, args in dict(tasks).items()}

    def get_task_info_for_set(self, start_info: dict, end_info: dict, task_filter: set) -> set:
        return {name for name, function in self.tasks.items()
                if name in task_filter and function(start_info=start_info, end_info=end_info)}

    @staticmethod
    def move_door_rel(joint_name: str, threshold: float, start_info: dict, end_info: dict) -> bool:
        start = start_info["scene_info"]["doors"][joint_name]["current_state"]
        end = end_info["scene_info"]["doors"][joint_name]["current_state"]
        return 0 < threshold < end - start or 0 > threshold > end - start
