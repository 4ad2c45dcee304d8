"""The one environment interface the evaluator, the collector and the recorder drive, and the table of simulators
behind it: a name picks the adapter, ``reach-v3`` (Meta-World, no prefix), ``libero:libero_object/0``,
``calvin:open_drawer`` or ``simpler:widowx_carrot_on_plate``.

Why one interface: closed-loop evaluation (receding-horizon chunks, batched lockstep episodes, videos, the random
baseline beside the policy) is the same loop whatever the simulator, so each simulator is adapted to it once --
seeded episodes, an 1-D float state, ``(H, W, 3)`` uint8 camera images under their own names, one action vector in
[-1, 1] per step and a success flag -- instead of the loop learning each package's API.

An environment (:class:`SimEnvironment`) is built cheaply (the simulator itself is built by the first
:meth:`~SimEnvironment.reset`), so its ``action_dim``, ``task`` text and ``max_steps`` can be read before any
episode runs. Adapter modules are imported only when their prefix is asked for, so a missing optional package
(``pip install "loongforge-embodied[libero]"``) fails only for its own names, in one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
from loongforge.errors import LoongForgeError


class SimEnvironmentError(LoongForgeError, ValueError):
    """An environment name, camera, seed or package that cannot work: one line saying what to change."""


@dataclass
class Observation:
    """One frame: the state vector (float64), camera images (H, W, 3) uint8 by camera name, and the reward of the
    step that led to it (0 after a reset)."""

    state: np.ndarray
    images: dict[str, np.ndarray] = field(default_factory=dict)
    reward: float = 0.0


@runtime_checkable
class SimEnvironment(Protocol):
    """What every adapter provides (Meta-World's :class:`~loongforge_embodied.sim.metaworld_env.MetaWorldEnv` is
    the first one)."""

    name: str
    #: The instruction a policy is conditioned on.
    task: str
    #: Camera names rendered into each observation (``observation.images.<name>`` of a dataset).
    cameras: tuple[str, ...]
    #: Length of the action vector :meth:`step` takes.
    action_dim: int
    #: The camera a video films unless told otherwise.
    video_camera: str
    #: LeRobot's ``robot_type`` of a dataset recorded from it.
    robot_type: str

    @property
    def fps(self) -> int: ...

    @property
    def max_steps(self) -> int: ...

    def reset(self, seed: int) -> Observation: ...

    def step(self, action: np.ndarray) -> tuple[Observation, bool]: ...

    def render(self, camera: str, size: int) -> np.ndarray: ...

    def close(self) -> None: ...


#: Name prefix -> ``module:class`` of its adapter (modules under ``loongforge_embodied.sim``).
ADAPTERS = {
    "libero": "libero_adapter:LiberoEnv",
    "calvin": "calvin_adapter:CalvinEnv",
    "simpler": "simpler_adapter:SimplerEnv",
}
#: Names without a prefix are Meta-World tasks.
DEFAULT_ADAPTER = "metaworld_env:MetaWorldEnv"


def adapter_class(name: str) -> type:
    """The adapter class for environment ``name`` (``prefix:spec`` or a bare Meta-World task)."""
    prefix, sep, _ = name.partition(":")
    if sep and prefix not in ADAPTERS:
        raise SimEnvironmentError(f"unknown environment prefix '{prefix}' in '{name}'; known: "
                                  f"{', '.join(f'{p}:' for p in ADAPTERS)} (or a Meta-World task such as reach-v3)")
    target = ADAPTERS[prefix] if sep else DEFAULT_ADAPTER
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(f"loongforge_embodied.sim.{module}"), cls)


def make_env(name: str, *, cameras: Sequence[str] = (), image_size: int = 64) -> SimEnvironment:
    """The environment ``name`` names, rendering ``cameras`` at ``image_size`` pixels a side each frame."""
    return adapter_class(name)(name, cameras=cameras, image_size=image_size)


def spec_of(name: str, prefix: str) -> str:
    """The part of ``name`` after ``prefix:`` (``"libero:libero_object/0"`` -> ``"libero_object/0"``)."""
    head, sep, spec = name.partition(":")
    if head != prefix or not sep or not spec:
        raise SimEnvironmentError(f"'{name}' is not a {prefix} environment name; write {prefix}:<task>")
    return spec


def missing_package(package: str, install: str, err: BaseException) -> SimEnvironmentError:
    """The one-line error for an adapter whose simulator package does not import: what failed and ``install``,
    how to get it."""
    return SimEnvironmentError(f"{package} does not import ({type(err).__name__}: {err}); {install}")


def check_cameras(cameras: Sequence[str], known: Sequence[str], simulator: str) -> tuple[str, ...]:
    """``cameras`` as a tuple, each one of ``known``; else a one-line error listing them."""
    unknown = sorted(set(cameras) - set(known))
    if unknown:
        raise SimEnvironmentError(f"unknown {simulator} cameras {unknown}; known: {', '.join(known)}")
    return tuple(cameras)


def clip_action(action: np.ndarray, action_dim: int, simulator: str) -> np.ndarray:
    """``action`` as float64 in [-1, 1], checked to hold ``action_dim`` values (a policy trained on another
    simulator's actions fails here, not deep inside the physics)."""
    array = np.asarray(action, np.float64).reshape(-1)
    if array.shape[0] != action_dim:
        raise SimEnvironmentError(f"{simulator} takes {action_dim} action values, got {array.shape[0]}")
    return np.clip(array, -1.0, 1.0)

