"""The policy task's ``task:`` section as typed dataclasses (:attr:`PolicyFlavor.task_options` of every policy).

Torch-free, because the flavors name these classes and are registered (and listed) without torch; core validates a
config's ``task:`` against them before a run starts (unknown keys with did-you-mean, types, the checks in
``__post_init__``), and :class:`loongforge_embodied.train_task.PolicyTask` reads the typed values. Every default is
the one the task always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loongforge.config.sections import path_field, ranged
from loongforge.errors import ConfigError


@dataclass(frozen=True)
class SyntheticOptions:
    """``task.synthetic``: the size of the synthetic reach set written when ``task.data`` is null."""

    episodes: int = ranged(64, low=1)
    length: int = ranged(20, low=1)
    seed: int = ranged(0, low=0)


@dataclass(frozen=True)
class EvalOptions:
    """``task.eval``: held-out frames scored after training (``frames: 0`` skips it), Euler steps, noise seed."""

    frames: int = ranged(128, low=0)
    steps: int = ranged(10, low=1)
    seed: int = ranged(0, low=0)


@dataclass(frozen=True)
class PolicyTaskOptions:
    """``task:`` of a policy flavor (see :mod:`loongforge_embodied.train_task` for what each option does)."""

    #: A LeRobotDataset root (v2.1/v3.0); null writes the synthetic reach set.
    data: str | None = path_field()
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)
    #: The last episodes: never trained on, used by the evaluation.
    held_out_episodes: int = ranged(8, low=0)
    #: Action chunk length H.
    action_horizon: int = ranged(10, low=1)
    #: States and actions: quantiles (Pi0.5), mean_std, min_max or identity.
    normalization: str = "quantiles"
    #: Camera keys in order; null takes the dataset's first ``cameras`` of the flavor.
    cameras: list[str] | None = None
    eval: EvalOptions = field(default_factory=EvalOptions)
    #: Activation checkpointing of every layer.
    recompute: bool = False

    def __post_init__(self) -> None:
        from loongforge_embodied.data.normalize import MODES  # numpy: imported when a config is checked, not listed

        if self.normalization not in MODES:
            raise ConfigError(f"normalization '{self.normalization}' is unknown; choose one of {', '.join(MODES)}")

    def split(self, episodes: list[int], root: Path | str, source: str) -> tuple[list[int], list[int]]:
        """``episodes`` (a dataset's indices, in order) as (training, held-out): the last ``held_out_episodes``
        are held out, and at least one must be left to train on."""
        held = self.held_out_episodes
        if not 0 <= held < len(episodes):
            raise ConfigError(f"task.held_out_episodes in {source}: {held}, but {root} has {len(episodes)} episodes "
                              "(keep at least one for training)")
        return episodes[:len(episodes) - held], episodes[len(episodes) - held:]
