"""A scripted expert for LIBERO's "pick up the X and place it in the basket" tasks (the libero_object suite).

LIBERO's recorded demonstrations live on a model hub this machine cannot reach, so demonstrations are scripted:
the expert reads the object's and the basket's positions from the simulator (privileged, as Meta-World's scripted
policies do) and drives the end effector through waypoints with OSC_POSE position deltas, orientation held:

1. above the object, gripper open; 2. down to grasp height; 3. close the gripper (a fixed number of steps);
4. lift; 5. above the basket; 6. lower a little; then open the gripper and hold.

The object's position is re-read every step until the grasp (objects settle or roll), the basket's when the
carry starts. Not every initial state gives a clean grasp; the collector keeps only episodes that succeed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Metres of position error that one unit of action corrects (OSC_POSE moves at most 5 cm per unit; a gain of
#: 10 saturates beyond 10 cm and slows near a waypoint).
GAIN = 10.0
#: Heights (m, world frame) relative to the object's origin or absolute.
ABOVE, GRASP, CARRY, RELEASE_ABOVE_BASKET = 0.10, 0.01, 0.30, 0.12
#: Steps the gripper is given to close before lifting.
CLOSE_STEPS = 15
#: A waypoint counts as reached within this distance (m).
REACHED = 0.012
OPEN, CLOSED = -1.0, 1.0


class PickPlaceExpert:
    """Stateful: one instance per episode; call with each observation, get a 7-d action."""

    def __init__(self, env: Any) -> None:
        objects = list(env.object_positions())
        if len(objects) != 2 or not objects[1].startswith("basket"):
            raise ValueError(f"the scripted LIBERO expert handles 'pick up X and place it in the basket' tasks; "
                             f"{env.name} has objects of interest {objects}")
        self.env, self.item, self.basket = env, objects[0], objects[1]
        self.phase, self.count = 0, 0
        self.target_basket: np.ndarray | None = None

    def __call__(self, observation: Any) -> np.ndarray:
        eef = observation.state[:3]
        positions = self.env.object_positions()
        item = positions[self.item]
        gripper = OPEN
        if self.phase == 0:
            target = item + [0, 0, ABOVE]
            self._advance(np.linalg.norm(target - eef) < REACHED * 2)
        elif self.phase == 1:
            target = item + [0, 0, GRASP]
            self._advance(np.linalg.norm(target - eef) < REACHED)
        elif self.phase == 2:
            target, gripper = item + [0, 0, GRASP], CLOSED
            self.count += 1
            self._advance(self.count >= CLOSE_STEPS)
        elif self.phase == 3:
            target, gripper = np.array([eef[0], eef[1], CARRY]), CLOSED
            if abs(eef[2] - CARRY) < REACHED * 2:
                self.target_basket = positions[self.basket] + [0, 0, RELEASE_ABOVE_BASKET]
                self._advance(True)
        elif self.phase == 4:
            target, gripper = np.array([*self.target_basket[:2], CARRY]), CLOSED
            self._advance(np.linalg.norm(target[:2] - eef[:2]) < REACHED)
        elif self.phase == 5:
            target, gripper = self.target_basket, CLOSED
            self._advance(np.linalg.norm(target - eef) < REACHED * 2)
        else:  # released over the basket: hold still with the gripper open
            target = self.target_basket
        action = np.zeros(7)
        action[:3] = np.clip((target - eef) * GAIN, -1.0, 1.0)
        action[6] = gripper
        return action.astype(np.float32)

    def _advance(self, done: bool) -> None:
        if done:
            self.phase, self.count = self.phase + 1, 0
