"""The interface between the loop and a step engine.

An engine supplies only what differs between model kinds: one optimizer step, saving and loading its state,
the optimizer's parameter groups, the counts the summary needs and its after-training work. Everything else --
step cadence, lifecycle hooks, ``should_stop``, the learning-rate schedule's stepping, metrics, progress,
checkpoint cadence and the summary -- is the loop's (:mod:`loongforge.train.loop`), so it behaves the same for
every model.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from loongforge.train.trainer import Trainer


@dataclass
class StepResult:
    """What one optimizer step reports: the loss (averaged over the global batch, known on every rank), the
    gradient norm (``None`` when clipping is off), whether the optimizer skipped the update (loss-scale overflow)
    and engine-specific numbers (``extra``, e.g. the MoE auxiliary loss) recorded with the step."""

    loss: float
    grad_norm: float | None
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class StepEngine(abc.ABC):
    """Base of the step engines; subclasses set the attributes in ``__init__`` and implement the methods."""

    #: ``"megatron"`` or ``"task"`` (:data:`loongforge.models.family.ENGINES`).
    name: ClassVar[str] = ""
    #: See :class:`loongforge.train.trainer.Trainer` for what each engine puts in these.
    model: Any
    optimizer: Any
    data: Any
    #: Samples (sequences, videos, robot frames) in one optimizer step over all data-parallel ranks; the
    #: learning-rate schedule counts these, as megatron's does.
    samples_per_step: int
    #: Tokens in one step (megatron engine: global batch x sequence length); ``None`` where tokens are not the unit.
    tokens_per_step: int | None = None
    #: MoE: the last step's tokens per expert, ``[layer][expert]`` (see :class:`~loongforge.train.trainer.Trainer`).
    expert_tokens: list[list[int]] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: the schedule writes each step's ``lr`` into them."""
        return self.optimizer.param_groups

    @abc.abstractmethod
    def train_step(self) -> StepResult:
        """One optimizer step over one global batch (forward, backward, gradient reduction, update)."""

    @abc.abstractmethod
    def save(self, trainer: Trainer) -> Path:
        """Write a checkpoint of ``trainer.step`` into ``trainer.checkpoints`` (collective); return its directory."""

    @abc.abstractmethod
    def load(self, trainer: Trainer, path: Path) -> None:
        """Restore the state ``save`` wrote at ``path`` (collective), setting ``trainer.step``."""

    def finish(self, trainer: Trainer) -> dict[str, Any]:
        """After the last step: what the engine adds to the run summary (a text sample, a task's scores)."""
        return {}
