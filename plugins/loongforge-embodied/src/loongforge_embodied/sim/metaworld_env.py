"""Meta-World tasks as seeded episodes: ``MetaWorldEnv(name).reset(seed)`` always starts the same episode.

Each seed builds Meta-World's goal-observable variant of the task (the class behind
``gym.make("Meta-World/goal_observable", ...)``) with that seed, so the goal and object positions are a function of
the seed alone. ``gym.make("Meta-World/MT1", seed=s)`` is avoided on purpose: it samples a list of 50 goals per
construction (1.2 s, 50 resets) and picks one per ``reset`` from an RNG that carries over between resets, so an
episode depends on what ran before it. The observation is the same 39 numbers either way: hand xyz, gripper
opening, two object poses (xyz + quaternion), the previous frame's first 18 values and the goal xyz.

Cameras are optional (off by default): rendering needs an OpenGL platform, ``MUJOCO_GL=egl`` (a GPU driver, or
Mesa's software EGL: about a second per 64-pixel frame on a busy 2-core machine) or ``MUJOCO_GL=osmesa`` (Debian's
``libosmesa6``). State-only policies need none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Task texts a policy is conditioned on; other tasks read their name (``"drawer-open-v3"`` -> "drawer open").
TASK_TEXTS = {
    "reach-v3": "reach the goal",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "window-open-v3": "open the window",
    "window-close-v3": "close the window",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
}
#: Meta-World's cameras (``corner*`` look at the table from its corners).
CAMERAS = ("topview", "corner", "corner2", "corner3", "behindGripper", "gripperPOV")


def task_text(name: str) -> str:
    """The instruction for task ``name`` (table above, else the name's words without the version)."""
    return TASK_TEXTS.get(name) or " ".join(name.split("-")[:-1])


def env_names() -> list[str]:
    """Every Meta-World v3 task name."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return sorted(ALL_V3_ENVIRONMENTS)


def expert(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Meta-World's scripted policy for ``name``: observation (39,) -> action (4,) clipped to [-1, 1]."""
    import metaworld.policies as policies

    class_name = "Sawyer" + "".join(part.capitalize() for part in name.split("-")) + "Policy"
    if not hasattr(policies, class_name):
        known = sorted(n for n in dir(policies) if n.startswith("Sawyer") and n.endswith("Policy"))
        raise ValueError(f"no scripted Meta-World policy for '{name}' (looked for {class_name}); known: "
                         f"{', '.join(known)}")
    policy = getattr(policies, class_name)()

    def act(observation: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():  # "Constant(s) may be too high": the env clips anyway, and so do we
            warnings.simplefilter("ignore")
            return np.clip(policy.get_action(observation), -1.0, 1.0).astype(np.float32)

    return act


@dataclass
class Observation:
    """One frame: the state vector (float64, as Meta-World returns it) and camera images (H, W, 3) uint8."""

    state: np.ndarray
    images: dict[str, np.ndarray] = field(default_factory=dict)


class MetaWorldEnv:
    """One Meta-World task; :meth:`reset` with a seed starts that seed's episode.

    :param name: the task, e.g. ``"reach-v3"`` (see :func:`env_names`).
    :param cameras: camera names to render each frame (``observation.images.<name>``); empty for state only.
    :param image_size: rendered images are square, this many pixels a side.
    """

    def __init__(self, name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> None:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

        key = f"{name}-goal-observable"
        if key not in ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE:
            raise ValueError(f"unknown Meta-World task '{name}'; known: {', '.join(env_names())}")
        unknown = sorted(set(cameras) - set(CAMERAS))
        if unknown:
            raise ValueError(f"unknown Meta-World cameras {unknown}; known: {', '.join(CAMERAS)}")
        self.name, self.cameras, self.image_size = name, tuple(cameras), image_size
        self.task = task_text(name)
        self._cls = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[key]
        self._renderer: Any = None
        self._env: Any = self._make(0)
        self._started = False
        #: Control frequency: one action every ``frame_skip`` physics steps (80 Hz for every v3 task).
        self.fps = round(1.0 / self._env.dt)
        #: Meta-World's episode limit (500 steps); stepping further raises.
        self.max_steps = int(self._env.max_path_length)

    def reset(self, seed: int) -> Observation:
        """Start the episode of ``seed`` (a fresh simulator, so nothing carries over from earlier episodes)."""
        self.close()
        self._env = self._make(seed)
        self._started = True
        state, _ = self._env.reset(seed=seed)
        return self._observe(state)

    def step(self, action: np.ndarray) -> tuple[Observation, bool]:
        """Apply ``action`` (4,) in [-1, 1]; returns the next observation and whether the task is now solved."""
        if not self._started:
            raise RuntimeError("call reset(seed) before step()")
        state, _, _, _, info = self._env.step(np.clip(np.asarray(action, np.float32), -1.0, 1.0))
        return self._observe(state), bool(info["success"])

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
        if self._env is not None:
            self._env.close()
        self._env = self._renderer = None
        self._started = False

    def _make(self, seed: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._cls(seed=seed)

    def _observe(self, state: np.ndarray) -> Observation:
        return Observation(np.asarray(state, np.float64), {cam: self._render(cam) for cam in self.cameras})

    def _render(self, camera: str) -> np.ndarray:
        """(S, S, 3) uint8 RGB from ``camera``. Meta-World's ``corner*`` cameras are mounted upside down (their
        images show the table hanging from the top), so those are turned by 180 degrees."""
        import mujoco

        if self._renderer is None:
            try:
                self._renderer = mujoco.Renderer(self._env.model, self.image_size, self.image_size)
            except Exception as err:  # mujoco raises plain Exceptions for a missing GL platform
                raise RuntimeError(
                    f"cannot render Meta-World cameras ({err}); set MUJOCO_GL=egl (GPU driver) or MUJOCO_GL=osmesa "
                    "(apt-get install libosmesa6), or collect without cameras") from err
        self._renderer.update_scene(self._env.data, camera=camera)
        image = self._renderer.render()
        return np.ascontiguousarray(image[::-1, ::-1] if camera.startswith("corner") else image)
