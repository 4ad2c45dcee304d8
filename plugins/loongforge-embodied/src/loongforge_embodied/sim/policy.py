"""Things that act: a trained checkpoint in this process, or uniform random actions (the baseline).

Both answer ``act(task, state, images, seed) -> (H, A) actions`` for one observation and ``act_batch(task, states,
images, seeds) -> (E, H, A)`` for E observations at once (what a batched closed-loop evaluation asks each step),
carry ``metadata`` (what the policy server sends on connect) and ``predicted_frames`` (the frames a world-action
model imagined in its last ``act_batch``, else ``None``), so the evaluator, the server and
:class:`~loongforge_embodied.sim.client.PolicyClient` use them interchangeably. Each observation of a batch has its
own seed, so its chunk is the one ``act`` gives it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.sim.protocol import PROTOCOL


class CheckpointPolicy:
    """A ``loongforge train`` policy checkpoint (or a checkpoint root's latest), ready to act.

    :param steps: Euler steps per sampled chunk.
    :param trust_code: let a ``pkg.module:attr`` model name in the checkpoint's config import its module (the
        user's ``--trust-code``; see :func:`loongforge.train.task_checkpoint.load_task_model`).
    """

    def __init__(self, checkpoint: str | Path, *, steps: int = 10, trust_code: bool = False) -> None:
        from loongforge.checkpoint.layout import CONFIG_YAML
        from loongforge.config.loader import load_config
        from loongforge.train.task_checkpoint import load_task_model

        self.task, self.model, self.path = load_task_model(checkpoint, trust_code=trust_code)
        config = load_config(self.path / CONFIG_YAML)
        #: The run's logging settings (its trackers), for where ``loongforge eval`` logs the results.
        self.logging = config.logging
        self.steps = steps
        state = self.task.state_dict()
        if "action_dim" not in state:
            raise ValueError(f"{self.path} holds no normaliser stats or dimensions (saved before the policy task "
                             "stored them); retrain, or resume it for a step, to act with it")
        self.metadata = {
            "type": "metadata", "protocol": PROTOCOL, "model": config.model.name,
            "checkpoint": str(self.path), "action_dim": int(state["action_dim"]),
            "horizon": int(state["action_horizon"]), "state_dim": int(state["state_dim"]),
            "cameras": list(state["camera_keys"]), "image_size": int(self.task.flavor.image_size), "steps": steps,
            "train_step": int(state["steps"]),
        }

    def act(self, task: str, state: np.ndarray, images: Mapping[str, np.ndarray] | None = None, *,
            seed: int = 0) -> np.ndarray:
        """One (H, A) action chunk for one observation, in the dataset's units (seeded sampling noise)."""
        return self.act_batch(task, np.asarray(state)[None], [images or {}], [seed])[0]

    def act_batch(self, task: str, states: np.ndarray, images: Sequence[Mapping[str, np.ndarray]],
                  seeds: Sequence[int]) -> np.ndarray:
        """(E, H, A) chunks for E observations in one forward pass per Euler step, each from its own seed."""
        import torch

        items = [self.task.observation_inputs(task, np.asarray(state), dict(views))
                 for state, views in zip(states, images, strict=True)]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        return np.asarray(self.task.act(self.model, batch, steps=self.steps, seed=list(seeds)))

    @property
    def predicted_frames(self) -> np.ndarray | None:
        """(E, frames, S, S, 3) uint8 camera frames the policy imagined in its last :meth:`act_batch` call (a
        world-action model), or ``None`` (a policy that predicts actions only)."""
        return self.task.predicted_frames


class RandomPolicy:
    """Uniform actions in [-1, 1] (Meta-World's action box), drawn from ``seed``: the chance-level baseline.

    It ignores its observation, but declares one like a checkpoint does (``state_dim``, ``cameras`` and their
    ``image_size``; by default any state and no cameras), so a server in front of it checks requests the same way."""

    #: It imagines no frames.
    predicted_frames = None

    def __init__(self, *, action_dim: int = 4, horizon: int = 10, state_dim: int | None = None,
                 cameras: tuple[str, ...] = (), image_size: int | None = None) -> None:
        self.metadata: dict[str, Any] = {
            "type": "metadata", "protocol": PROTOCOL, "model": "random", "action_dim": action_dim,
            "horizon": horizon, "state_dim": state_dim, "cameras": list(cameras), "image_size": image_size,
        }

    def act(self, task: str, state: np.ndarray, images: Mapping[str, np.ndarray] | None = None, *,
            seed: int = 0) -> np.ndarray:
        shape = (self.metadata["horizon"], self.metadata["action_dim"])
        return np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)

    def act_batch(self, task: str, states: np.ndarray, images: Sequence[Mapping[str, np.ndarray]],
                  seeds: Sequence[int]) -> np.ndarray:
        return act_each(self.act, task, states, images, seeds)


def act_each(act: Callable[..., np.ndarray], task: str, states: np.ndarray,
             images: Sequence[Mapping[str, np.ndarray]], seeds: Sequence[int]) -> np.ndarray:
    """``act_batch`` of a policy that acts on one observation at a time: ``act`` on each, stacked."""
    return np.stack([act(task, state, views, seed=seed) for state, views, seed in zip(states, images, seeds,
                                                                                         strict=True)])
