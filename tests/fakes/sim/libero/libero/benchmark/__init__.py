"""FAKE ``libero.libero.benchmark``: ``get_benchmark_dict`` -> suite classes whose instances answer
``get_num_tasks``, ``get_task`` (a ``Task`` named tuple) and ``get_task_init_states`` (LIBERO's
``libero/libero/benchmark/__init__.py``). One suite, ``libero_object``, with one task.

An initial state here is 9 numbers -- end effector, item and basket positions -- read by the fake simulator;
LIBERO's are flattened MuJoCo states (110 numbers for this task), which the adapter passes through untouched."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Task(NamedTuple):
    name: str
    language: str
    problem: str
    problem_folder: str
    bddl_file: str
    init_states_file: str


TASK = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"


class LIBERO_OBJECT:  # noqa: N801 -- LIBERO's class name
    def __init__(self, task_order_index: int = 0) -> None:
        self.tasks = [Task(TASK, TASK.replace("_", " "), "Libero", "libero_object", f"{TASK}.bddl",
                           f"{TASK}.pruned_init")]

    def get_num_tasks(self) -> int:
        return len(self.tasks)

    def get_task(self, i: int) -> Task:
        return self.tasks[i]

    def get_task_init_states(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(i)
        count = 50
        eef = np.tile([-0.15, 0.0, 0.25], (count, 1))
        item = np.column_stack([rng.uniform(-0.2, 0.0, count), rng.uniform(-0.3, -0.1, count), np.full(count, 0.04)])
        basket = np.column_stack([rng.uniform(0.0, 0.1, count), rng.uniform(0.15, 0.3, count), np.zeros(count)])
        return np.concatenate([eef, item, basket], axis=1)


def get_benchmark_dict(help: bool = False) -> dict[str, type]:
    return {"libero_object": LIBERO_OBJECT}
