"""Numerical health of training steps: which step is bad, and what ``training.on_nonfinite`` does about it.

A step is bad when its loss or gradient norm is NaN or infinite; when its loss spikes -- more than
``training.spike_factor`` times, and ``training.spike_min_increase`` above, the median loss of the previous
``training.spike_window`` healthy steps (compared from the :data:`SPIKE_MIN_STEPS`-th step on; a bad step's loss
never enters that window, so one spike does not raise the bar for the next); or when the model has collapsed:
``training.collapse_steps`` steps in a row with a gradient norm of exactly 0, or a loss that does not move (by
more than :data:`FLAT_LOSS` of itself) while the learning rate is above 0 -- a model that learns nothing any more,
whose checkpoints must not be the ones a rewind or a resume goes back to. The steps of such a streak are
*suspect* from its first step: a checkpoint saved while the streak runs is not healthy (:attr:`StepHealth.suspect`),
and the loop rewinds to, and names, the newest healthy one.

When the verdict is made matters. ``stop`` and ``rewind`` judge a step after it ran, from the two numbers the step
reports anyway, so the default costs nothing. ``skip_step`` must decide *before* the optimizer applies the update
-- megatron's fp32 optimizer applies a NaN gradient (the clip coefficient becomes NaN) and Adam's moments and step
count would change either way -- so the step engines call :meth:`StepHealth.screen` between backward and the
optimizer step and leave the update out when it answers with a :class:`BadStep`.

Torch-free, like the loop that owns it (:mod:`loongforge.train.loop`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from loongforge.config.schema import TrainingConfig

#: :attr:`BadStep.kind` values, as recorded in metrics.jsonl (``"bad"``).
NONFINITE, SPIKE, COLLAPSE = "nonfinite", "spike", "collapse"
#: Healthy steps spike detection needs before it compares (fewer if ``spike_window`` is smaller).
SPIKE_MIN_STEPS = 3
#: A loss that moves by at most this fraction of itself from one step to the next is flat.
FLAT_LOSS = 1e-6


@dataclass(frozen=True)
class BadStep:
    """Why a step is bad: ``kind`` (:data:`NONFINITE`, :data:`SPIKE` or :data:`COLLAPSE`), the quantity (``loss``,
    ``grad_norm``, or ``gradients`` when an engine checked the gradients before their norm existed) and its value;
    for a spike, the factor, the median it was compared with and over how many steps that median was taken; for a
    collapse, over how many steps (``window``) and from which step on (``since``)."""

    kind: str
    key: str
    value: float
    factor: float | None = None
    median: float | None = None
    window: int | None = None
    since: int | None = None

    def describe(self) -> str:
        """The phrase the error, the warning and the metrics name the step by."""
        if self.kind == SPIKE:
            return (f"loss spike: {self.value!r} > {self.factor} x {self.median!r} (the median loss of the previous "
                    f"{self.window} steps)")
        if self.kind == COLLAPSE:
            what = "gradient norm exactly 0" if self.key == "grad_norm" else f"loss flat at {self.value!r}"
            return (f"collapse: {what} with a learning rate above 0 for {self.window} steps in a row (since step "
                    f"{self.since})")
        if self.key == "gradients":
            return f"gradients are not finite ({self.value})"
        return f"{self.key} is {self.value}"


class StepHealth:
    """The verdicts of one run's steps, the recent losses spike detection compares with, and the recoveries used."""

    def __init__(self, training: TrainingConfig, *, watch_loss: bool = True) -> None:
        """``watch_loss``: whether the loss is one whose spikes and flat runs mean trouble (the engine's
        :attr:`~loongforge.train.engines.base.StepEngine.loss_tracks_progress`); without, only non-finite numbers
        are bad."""
        self.policy = training.on_nonfinite
        self.max_recoveries = training.max_recoveries
        self._factor = training.spike_factor if watch_loss else None
        self._min_increase = training.spike_min_increase
        self._recent: deque[float] = deque(maxlen=training.spike_window)
        self._collapse_steps = training.collapse_steps if watch_loss else None
        #: The current streak of collapse signs: ``(first step, length, quantity, value)``; ``None``: no streak.
        self._streak: tuple[int, int, str, float] | None = None
        self._last_loss: float | None = None
        #: Bad steps met so far in this run (each recovered one counts against ``max_recoveries``).
        self.bad_steps = 0

    @property
    def suspect(self) -> bool:
        """Whether the steps since the last healthy one show signs of a collapse (a streak shorter than
        ``collapse_steps`` so far): a checkpoint saved now is not a healthy one to go back to."""
        return self._streak is not None

    @property
    def screens_updates(self) -> bool:
        """Whether engines must judge a step before its update (``skip_step``: the update is then left out)."""
        return self.policy == "skip_step"

    def screen(self, loss: float, gradients: Callable[[], float]) -> BadStep | None:
        """Before the optimizer step: the step's loss, then -- only if it passed -- ``gradients()``, a number that
        is finite exactly when every gradient is (their norm, or their sum over all ranks).

        The loss is the same on every rank, so either every rank calls ``gradients`` (which may be collective)
        or none does."""
        return self._loss_verdict(loss) or _nonfinite("gradients", gradients())

    def judge(self, loss: float, grad_norm: float | None, *, lr: float = 0.0, step: int = 0) -> BadStep | None:
        """After step ``step`` (run with learning rate ``lr``): the loss (finite, no spike), then the gradient norm
        (``None``: not computed), then whether the model has collapsed."""
        return (self._loss_verdict(loss) or (None if grad_norm is None else _nonfinite("grad_norm", grad_norm))
                or self._collapse_verdict(loss, grad_norm, lr, step))

    def accept(self, loss: float) -> None:
        """A healthy step's loss joins the window spike detection compares with."""
        self._recent.append(loss)

    def _collapse_verdict(self, loss: float, grad_norm: float | None, lr: float, step: int) -> BadStep | None:
        """Extend or end the streak of collapse signs with this step; a streak of ``collapse_steps`` is bad."""
        previous, self._last_loss = self._last_loss, loss
        if self._collapse_steps is None or lr <= 0:
            self._streak = None
            return None
        sign = None
        if grad_norm == 0.0:
            sign = ("grad_norm", grad_norm)
        elif previous is not None and abs(loss - previous) <= FLAT_LOSS * abs(loss):
            sign = ("loss", loss)
        if sign is None:
            self._streak = None
            return None
        first, length = (self._streak[0], self._streak[1] + 1) if self._streak is not None else (step, 1)
        self._streak = (first, length, *sign)
        if length < self._collapse_steps:
            return None
        self._streak = None  # judged: the next streak starts afresh (after a rewind, from the checkpoint's state)
        return BadStep(COLLAPSE, sign[0], sign[1], window=length, since=first)

    def decide(self, *, discarded: bool, can_rewind: bool) -> tuple[str, str]:
        """Count one more bad step; return what to do -- ``stop``, ``skip_step`` or ``rewind`` -- and, when that is
        ``stop`` although the policy recovers, why (for the error message).

        ``discarded``: the engine left this step's update out (only ``skip_step`` screens); ``can_rewind``: there
        is a checkpoint to go back to."""
        self.bad_steps += 1
        if self.policy == "stop":
            return "stop", ""
        if self.bad_steps > self.max_recoveries:
            return "stop", f"; bad step {self.bad_steps}, over training.max_recoveries {self.max_recoveries}"
        if self.policy == "skip_step" and not discarded:
            return "stop", "; its update was applied before the step could be judged"
        if self.policy == "rewind" and not can_rewind:
            return "stop", "; no checkpoint to rewind to yet"
        return self.policy, ""

    def _loss_verdict(self, loss: float) -> BadStep | None:
        if not math.isfinite(loss):
            return BadStep(NONFINITE, "loss", loss)
        if self._factor is not None and len(self._recent) >= min(SPIKE_MIN_STEPS, self._recent.maxlen or 1):
            median = statistics.median(self._recent)
            # a ratio means nothing for a loss at or below 0; near 0 it needs an absolute rise too
            if median > 0 and loss > self._factor * median and loss - median > self._min_increase:
                return BadStep(SPIKE, "loss", loss, factor=self._factor, median=median, window=len(self._recent))
        return None


def _nonfinite(key: str, value: float) -> BadStep | None:
    return None if math.isfinite(value) else BadStep(NONFINITE, key, value)
