"""Meta-World tasks as seeded episodes: ``MetaWorldEnv(name).reset(seed)`` always starts the same episode.

Each seed builds Meta-World's goal-observable variant of the task (the class behind
``gym.make("Meta-World/goal_observable", ...)``) with that seed, so the goal and object positions are a function of
the seed alone. ``gym.make("Meta-World/MT1", seed=s)`` is avoided on purpose: it samples a list of 50 goals per
construction (1.2 s, 50 resets) and picks one per ``reset`` from an RNG that carries over between resets, so an
episode depends on what ran before it. The observation is the same 39 numbers either way: hand xyz, gripper
opening, two object poses (xyz + quaternion), the previous frame's first 18 values and the goal xyz.

Cameras are optional (off by default): rendering needs an OpenGL platform, ``MUJOCO_GL=egl`` (a GPU driver, or
Mesa's software EGL) or ``MUJOCO_GL=osmesa`` (Debian's ``libosmesa6``). State-only policies need none. A process
that renders and has no display picks EGL itself (:func:`use_headless_gl`): MuJoCo's own default, GLFW, needs a
window system. Frames are rendered without shadows and multisampling (:data:`PLAIN_RENDERING`): Meta-World's models
ask for a 4096-pixel shadow map and 4x multisampling, which in software EGL cost ~0.6 s a frame on a busy 2-core
machine whatever the image size, against ~0.014 s for a 32-pixel frame without them (its mean pixel value moved by
0.3 of 255).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from loongforge_embodied.sim.environment import Observation, SimEnvironmentError

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


class MetaWorldError(SimEnvironmentError):
    """An unknown task or camera, or rendering without an OpenGL platform: one line saying what to change."""


def use_headless_gl() -> None:
    """Choose MuJoCo's EGL backend when nothing chose one and there is no display, so a headless machine renders
    without extra settings. MuJoCo reads ``MUJOCO_GL`` once, when it is first imported: call this before that
    (:class:`MetaWorldEnv` does when it has cameras; the evaluator does before recording videos)."""
    if "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
        os.environ["MUJOCO_GL"] = "egl"


#: MuJoCo ``model.vis.quality`` settings every renderer is made with: no shadow map, no multisampling (see the
#: module docstring for the cost of Meta-World's own).
PLAIN_RENDERING = {"shadowsize": 0, "offsamples": 0}
#: ``MUJOCO_GL`` values with which MuJoCo renders nothing.
GL_OFF = ("disable", "disabled", "off", "false", "0")
#: What to do when rendering fails (the end of the error message).
GL_HINT = ("set MUJOCO_GL=egl (GPU driver or Mesa's EGL) or MUJOCO_GL=osmesa (apt-get install libosmesa6), or run "
           "without cameras and videos")


def _goal_observable_envs() -> dict[str, Any]:
    """Meta-World's goal-observable task classes by name. Importing Meta-World imports MuJoCo, which sets up the
    ``MUJOCO_GL`` backend then: a backend whose library is missing fails there, and says so here in one line."""
    try:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE
    except ModuleNotFoundError as err:
        raise MetaWorldError(f"Meta-World is not installed ({err}): pip install 'loongforge-embodied[sim]'") from err
    except Exception as err:  # PyOpenGL raises AttributeError/ImportError for a backend it cannot load
        raise MetaWorldError(f"cannot load MuJoCo with MUJOCO_GL={os.environ.get('MUJOCO_GL', '')!r} "
                             f"({type(err).__name__}: {err}); {GL_HINT}") from err
    return ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE


def task_text(name: str) -> str:
    """The instruction for task ``name`` (table above, else the name's words without the version)."""
    return TASK_TEXTS.get(name) or " ".join(name.split("-")[:-1])


def env_names() -> list[str]:
    """Every Meta-World v3 task name."""
    return sorted(key.removesuffix("-goal-observable") for key in _goal_observable_envs())


def expert(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Meta-World's scripted policy for ``name``: observation (39,) -> action (4,) clipped to [-1, 1]."""
    import metaworld.policies as policies

    class_name = "Sawyer" + "".join(part.capitalize() for part in name.split("-")) + "Policy"
    if not hasattr(policies, class_name):
        known = sorted(n for n in dir(policies) if n.startswith("Sawyer") and n.endswith("Policy"))
        raise MetaWorldError(f"no scripted Meta-World policy for '{name}' (looked for {class_name}); known: "
                         f"{', '.join(known)}")
    policy = getattr(policies, class_name)()

    def act(observation: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():  # "Constant(s) may be too high": the env clips anyway, and so do we
            warnings.simplefilter("ignore")
            return np.clip(policy.get_action(observation), -1.0, 1.0).astype(np.float32)

    return act


class MetaWorldEnv:
    """One Meta-World task; :meth:`reset` with a seed starts that seed's episode.

    :param name: the task, e.g. ``"reach-v3"`` (see :func:`env_names`).
    :param cameras: camera names to render each frame (``observation.images.<name>``); empty for state only.
    :param image_size: rendered images are square, this many pixels a side.
    """

    #: Hand xyz delta and gripper effort.
    action_dim = 4
    video_camera = "corner"
    robot_type = "sawyer"

    def __init__(self, name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> None:
        if cameras:
            use_headless_gl()
        envs = _goal_observable_envs()
        key = f"{name}-goal-observable"
        if key not in envs:
            raise MetaWorldError(f"unknown Meta-World task '{name}'; known: {', '.join(env_names())}")
        unknown = sorted(set(cameras) - set(CAMERAS))
        if unknown:
            raise MetaWorldError(f"unknown Meta-World cameras {unknown}; known: {', '.join(CAMERAS)}")
        self.name, self.cameras, self.image_size = name, tuple(cameras), image_size
        self.task = task_text(name)
        self._cls = envs[key]
        #: One MuJoCo renderer per image side (the policy's cameras and a video may differ), made on first use.
        self._renderers: dict[int, Any] = {}
        #: The simulator, built by :meth:`reset` (a build compiles the MuJoCo model: ~0.2 s, the bulk of a short
        #: episode, so none is built before an episode needs it).
        self._env: Any = None
        self._started = False

    @property
    def fps(self) -> int:
        """Control frequency: one action every ``frame_skip`` physics steps (80 Hz for every v3 task)."""
        return round(1.0 / self._simulator().dt)

    @property
    def max_steps(self) -> int:
        """Meta-World's episode limit (500 steps); stepping further raises. A class attribute: read without a
        simulator."""
        return int(self._cls.max_path_length)

    def _simulator(self) -> Any:
        """The current simulator; before the first :meth:`reset`, seed 0's (built once, kept until a reset)."""
        if self._env is None:
            self._env = self._make(0)
        return self._env

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
        state, reward, _, _, info = self._env.step(np.clip(np.asarray(action, np.float32), -1.0, 1.0))
        return self._observe(state, float(reward)), bool(info["success"])

    def close(self) -> None:
        for renderer in self._renderers.values():
            renderer.close()
        if self._env is not None:
            self._env.close()
        self._env, self._renderers = None, {}
        self._started = False

    def scripted_expert(self) -> Callable[[Observation], np.ndarray]:
        """Meta-World's scripted policy for this task, acting on an observation (stateless: one per episode too)."""
        act = expert(self.name)
        return lambda observation: act(observation.state)

    def _make(self, seed: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._cls(seed=seed)

    def _observe(self, state: np.ndarray, reward: float = 0.0) -> Observation:
        images = {cam: self.render(cam, self.image_size) for cam in self.cameras}
        return Observation(np.asarray(state, np.float64), images, reward)

    def render(self, camera: str, size: int) -> np.ndarray:
        """(size, size, 3) uint8 RGB of the current frame from ``camera`` (reading the simulation, not changing
        it: an episode is the same with or without rendering). Meta-World's ``corner*`` cameras are mounted upside
        down (their images show the table hanging from the top), so those are turned by 180 degrees."""
        import mujoco

        if camera not in CAMERAS:
            raise MetaWorldError(f"unknown Meta-World camera '{camera}'; known: {', '.join(CAMERAS)}")
        if os.environ.get("MUJOCO_GL", "").strip().lower() in GL_OFF:
            raise MetaWorldError(f"cannot render Meta-World cameras: MUJOCO_GL={os.environ['MUJOCO_GL']} turns "
                                 f"rendering off; {GL_HINT}")
        if size not in self._renderers:
            model = self._simulator().model
            for name, value in PLAIN_RENDERING.items():  # read when the renderer's GL context is made
                setattr(model.vis.quality, name, value)
            try:
                self._renderers[size] = mujoco.Renderer(model, size, size)
            except Exception as err:  # mujoco raises plain Exceptions for a missing GL platform
                raise MetaWorldError(f"cannot render Meta-World cameras ({' '.join(str(err).split())}); "
                                     f"{GL_HINT}") from err
        renderer = self._renderers[size]
        renderer.update_scene(self._simulator().data, camera=camera)
        image = renderer.render()
        return np.ascontiguousarray(image[::-1, ::-1] if camera.startswith("corner") else image)
