"""Named parameter groups a model family declares, each with its own optimizer settings.

Why a family slot (:meth:`loongforge.models.family.ModelFamily.parameter_groups`): a composed model's parts -- a
vision-language model's encoder, projector and language backbone -- want different learning rates and weight decay,
or no training at all, and a staged recipe trains one part only after another has aligned. Core builds both
engines' optimizers and the one learning-rate schedule, so core applies the settings; only the family knows which
parameters make up a part and what its config calls them, so the family names the groups. Core never names a part.

A parameter belongs to the first group whose ``fnmatch`` patterns match its TP=1/PP=1 name (the names
``model.freeze`` matches), so a family can carve a sub-part out of a part by listing it first (a Qwen ViT's patch
merger out of the encoder); a parameter no group matches follows ``optimizer:``. Torch-free: ``loongforge check``
validates the values without building anything.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError


@dataclass(frozen=True)
class ParameterGroup:
    """One named group: which parameters, and how they train.

    ``lr``/``min_lr``/``weight_decay`` replace ``optimizer.lr``/``min_lr``/``weight_decay`` for the group (``None``:
    the run's; a ``min_lr`` left unset keeps the run's decay ratio, ``lr * optimizer.min_lr / optimizer.lr``). The
    group follows the run's warmup and decay with its own peak and floor. ``frozen``: its parameters never train
    (no gradients, no optimizer state, as ``model.freeze``). ``unfreeze_at_step = N``: steps 1..N leave the group
    unchanged (learning rate 0; a checkpoint at step N still holds its starting weights), step N+1 on train it
    with the rate the run's schedule gives at that step. ``key`` is the config key the settings come from
    (``model.encoder``), named in messages and in the settings a resumed run must agree on.
    """

    name: str
    patterns: tuple[str, ...]
    key: str
    lr: float | None = None
    min_lr: float | None = None
    weight_decay: float | None = None
    frozen: bool = False
    unfreeze_at_step: int = 0

    @property
    def tuned(self) -> bool:
        """Whether the group trains differently from ``optimizer:`` (only such groups get an optimizer group)."""
        return (self.lr, self.min_lr, self.weight_decay) != (None, None, None) or self.unfreeze_at_step > 0

    def peak_and_floor(self, lr: float, min_lr: float) -> tuple[float, float]:
        """The group's peak and final learning rate given the run's ``lr``/``min_lr``; a floor above the peak is a
        one-line :class:`ConfigError` naming the key."""
        peak = lr if self.lr is None else self.lr
        floor = self.min_lr if self.min_lr is not None else (peak * min_lr / lr if lr > 0 else 0.0)
        if floor > peak:
            raise ConfigError(f"{self.key}: min_lr ({floor}) is above its lr ({peak})")
        return peak, floor

    def scheduler_keys(self, lr: float, min_lr: float, weight_decay: float) -> dict[str, Any]:
        """The keys of an optimizer parameter group that megatron's ``OptimizerParamScheduler`` reads per group
        (``max_lr``, ``min_lr``, ``start_wd``/``end_wd``), plus ``group_name`` (metrics log ``lr/<name>``) and
        ``unfreeze_at_step`` (:class:`loongforge.train.optim.PartScheduler`)."""
        peak, floor = self.peak_and_floor(lr, min_lr)
        decay = weight_decay if self.weight_decay is None else self.weight_decay
        return {"group_name": self.name, "max_lr": peak, "min_lr": floor, "start_wd": decay, "end_wd": decay,
                "unfreeze_at_step": self.unfreeze_at_step}

    def settings(self) -> dict[str, Any]:
        """``{config key: value}`` of what the group sets (unset values left out), which a resumed run must agree on
        (:mod:`loongforge.train.resume_settings`)."""
        values = {"lr": self.lr, "min_lr": self.min_lr, "weight_decay": self.weight_decay,
                  "freeze": self.frozen or None, "unfreeze_at_step": self.unfreeze_at_step or None}
        return {f"{self.key}.{name}": value for name, value in values.items() if value is not None}


def group_of(name: str, groups: Sequence[ParameterGroup]) -> ParameterGroup | None:
    """The first group whose patterns match the parameter name ``name``, or ``None``."""
    return next((g for g in groups if any(fnmatch.fnmatchcase(name, p) for p in g.patterns)), None)
