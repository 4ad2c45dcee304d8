"""Things that act: a trained checkpoint in this process, or uniform random actions (the baseline).

Both answer ``act(task, state, images, seed) -> (H, A) actions`` and carry ``metadata`` (what the policy server
sends on connect), so the evaluator, the server and :class:`~loongforge_embodied.sim.client.PolicyClient` use
them interchangeably.
"""

from __future__ import annotations

from collections.abc import Mapping
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
        self.steps = steps
        state = self.task.state_dict()
        if "action_dim" not in state:
            raise ValueError(f"{self.path} holds no normaliser stats or dimensions (saved before the policy task "
                             "stored them); retrain, or resume it for a step, to act with it")
        self.metadata = {
            "type": "metadata", "protocol": PROTOCOL, "model": load_config(self.path / CONFIG_YAML).model.name,
            "checkpoint": str(self.path), "action_dim": int(state["action_dim"]),
            "horizon": int(state["action_horizon"]), "state_dim": int(state["state_dim"]),
            "cameras": list(state["camera_keys"]), "image_size": int(self.task.flavor.image_size), "steps": steps,
        }

    def act(self, task: str, state: np.ndarray, images: Mapping[str, np.ndarray] | None = None, *,
            seed: int = 0) -> np.ndarray:
        """One (H, A) action chunk for one observation, in the dataset's units (seeded sampling noise)."""
        inputs = self.task.observation_inputs(task, np.asarray(state), dict(images or {}))
        batch = {key: value[None] for key, value in inputs.items()}
        return np.asarray(self.task.act(self.model, batch, steps=self.steps, seed=seed))[0]


class RandomPolicy:
    """Uniform actions in [-1, 1] (Meta-World's action box), drawn from ``seed``: the chance-level baseline.

    It ignores its observation, but declares one like a checkpoint does (``state_dim``, ``cameras`` and their
    ``image_size``; by default any state and no cameras), so a server in front of it checks requests the same way."""

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
