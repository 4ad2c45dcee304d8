"""The interface between the loop and a step engine.

An engine supplies only what differs between model kinds: one optimizer step, the validation loss of the current
weights, saving and loading its state, its position in the data, the optimizer's parameter groups, the counts the
summary needs and its after-training work. Everything else -- step cadence, lifecycle hooks, ``should_stop``, the
learning-rate schedule's stepping, metrics, progress, checkpoint and evaluation cadence, the summary and what a bad
step does (:mod:`loongforge.train.health`) -- is the loop's (:mod:`loongforge.train.loop`), so it behaves the same
for every model.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from loongforge.train.health import BadStep, StepHealth
    from loongforge.train.trainer import Trainer


@dataclass
class StepResult:
    """What one optimizer step reports: the loss (averaged over the global batch, known on every rank), the
    gradient norm (``None`` when clipping is off or it was not computed), whether the update was left out (a
    loss-scale overflow, or ``bad``), why the screen made the engine leave it out (``bad``; see
    :meth:`StepEngine.train_step`) and engine-specific numbers (``extra``, e.g. the MoE auxiliary loss) recorded
    with the step."""

    loss: float
    grad_norm: float | None
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    bad: BadStep | None = None


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
    #: Model training FLOPs of one step over all ranks (forward and backward, recompute left out), from which the
    #: loop reports ``tflops`` and ``mfu`` (:mod:`loongforge.train.throughput`); ``None`` where the engine does not
    #: count them.
    flops_per_step: float | None = None
    #: Whether the step's loss falls as training goes (a cross-entropy), so that a spike or a flat run of it is a
    #: sign of trouble (:mod:`loongforge.train.health`); a policy-gradient loss is not one (it is exactly 0 whenever
    #: every group's replies score alike), and only its non-finite values are bad.
    loss_tracks_progress: ClassVar[bool] = True
    #: MoE: the last step's tokens per expert, ``[layer][expert]`` (see :class:`~loongforge.train.trainer.Trainer`).
    expert_tokens: list[list[int]] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: the schedule writes each step's ``lr`` into them."""
        return self.optimizer.param_groups

    @abc.abstractmethod
    def train_step(self, screen: StepHealth | None = None) -> StepResult:
        """One optimizer step over one global batch (forward, backward, gradient reduction, update).

        With a ``screen`` (``training.on_nonfinite: skip_step``), ask ``screen.screen`` after backward and before
        the optimizer step; when it returns a :class:`~loongforge.train.health.BadStep`, leave the update out --
        weights, optimizer moments and step count, and any after-step work (an EMA) stay as they were -- and
        return ``skipped=True`` with that ``bad``. Without one, check nothing beyond what the step reports."""

    @abc.abstractmethod
    def save(self, trainer: Trainer) -> Path | None:
        """Write a checkpoint of ``trainer.step`` into ``trainer.checkpoints`` (collective); return its directory.

        With ``checkpoint.async_save`` only snapshot the state (a host copy) and return ``None``: the files are
        written in the background and :meth:`complete_save` commits them. A save still pending when this is
        called is committed first."""

    @abc.abstractmethod
    def complete_save(self, trainer: Trainer, *, wait: bool) -> Path | None:
        """Commit the background save :meth:`save` left pending once every rank has written its part (``wait``:
        block until then); return the committed directory, ``None`` when nothing was committed. The loop calls this
        at every step boundary and with ``wait=True`` before training ends. Collective (all ranks call it at the
        same points); without a pending save it returns ``None`` at once."""

    @abc.abstractmethod
    def load(self, trainer: Trainer, path: Path) -> None:
        """Restore the state ``save`` wrote at ``path`` (collective), setting ``trainer.step``. The schedule is
        moved on from wherever ``trainer.scheduler`` stands by the checkpoint's count (megatron's convention), so
        the loop hands a mid-run load a schedule counted back to zero."""

    @abc.abstractmethod
    def data_position(self) -> Any:
        """Where the next batch comes from, as a checkpoint stores it (``training.on_nonfinite: rewind`` keeps
        it across the reload, so that the batches after the bad one come next)."""

    @abc.abstractmethod
    def seek_data(self, position: Any) -> None:
        """Continue the data from a :meth:`data_position`."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """The current weights' numbers on the validation batches (``evaluation:``), known on every rank; the loop
        records each as ``val_<name>`` (JSONL) and ``val/<name>`` (TensorBoard). Every engine reports ``loss``.

        Called only when ``evaluation.interval > 0``, between two steps and on every rank (collective). Forward only:
        no gradient, the model in eval mode and then back in the mode it was in, and the same fixed batches (and,
        for draws a loss needs, the same seeded streams) every time, so the number is deterministic and comparable
        across steps and resumed runs. It must leave training exactly as it found it -- the data position, the
        weights, the optimizer and every random stream the next step draws from (the loop also restores the
        process-wide streams around it) -- so that a run trains the same losses with evaluation on as off."""

    def log_records(self, trainer: Trainer, step: int) -> None:
        """At each logging step, on every rank, after the step's numbers: what the engine records beside them (GRPO's
        sampled replies, to ``rollouts.jsonl`` and the trackers' tables). Nothing by default."""
        return None

    def finish(self, trainer: Trainer) -> dict[str, Any]:
        """After the last step: what the engine adds to the run summary (a text sample, a task's scores)."""
        return {}
