"""What a resumed run must agree on with its checkpoint: the optimizer and learning-rate schedule settings.

Why a check: the schedule is state (megatron's scheduler stores its own warmup, decay and peak values and, on load,
keeps them), so a run resumed with a new ``optimizer.lr`` or ``scheduler.warmup_steps`` used to continue some mix
of old and new curves without a word, and its ``trainer.json`` recorded values that never ran. Now every
checkpoint records the settings it was trained with (in config-key terms, with defaults resolved: the decay length
that ``training.steps`` implied, the global batch size in samples), and a resume compares them with the new
config: a difference is a one-line :class:`~loongforge.errors.ConfigError` listing each key with both values,
unless ``checkpoint.override_schedule: true`` says the new values are meant. Then the schedule is rebuilt from the
new config and continues at the resumed step (samples seen so far), and the optimizer's hyper-parameters are the
new config's; the Adam moments and the weights are the checkpoint's. A DPO run also records its objective and reference
(``dpo.*``, :func:`loongforge.train.preference.settings.dpo_settings`): resuming it as another loss would train
something else under the same step count.

Torch-free: both step engines call it, and it needs only the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.models.parameter_groups import ParameterGroup
from loongforge.train.preference.settings import dpo_settings
from loongforge.train.rl.settings import grpo_settings

#: The key under which a checkpoint's ``trainer.json`` records :func:`schedule_settings`.
SETTINGS_KEY = "schedule_settings"


def schedule_settings(config: LoongForgeConfig, samples_per_step: int,
                      groups: Sequence[ParameterGroup] = ()) -> dict[str, Any]:
    """The optimizer and schedule settings this run trains with, as ``{config key: value}``.

    ``scheduler.decay_steps`` is the effective decay length (``training.steps`` when unset, at least warmup + 1, as
    :func:`loongforge.train.optim.build_scheduler` builds it), so extending ``training.steps`` of a run whose decay
    followed it shows up as the schedule change it is; a constant schedule has none (extending it changes nothing).
    The model family's parameter ``groups`` add what each sets (``model.encoder.lr`` ...)."""
    opt, sched = config.optimizer, config.scheduler
    decay_steps = sched.decay_steps if sched.decay_steps is not None else config.training.steps
    return {
        "optimizer.name": opt.name.lower(),
        "optimizer.lr": opt.lr,
        "optimizer.min_lr": opt.min_lr,
        "optimizer.weight_decay": opt.weight_decay,
        "optimizer.beta1": opt.beta1,
        "optimizer.beta2": opt.beta2,
        "optimizer.eps": opt.eps,
        "optimizer.grad_clip": opt.grad_clip,
        "scheduler.warmup_steps": sched.warmup_steps,
        "scheduler.decay": sched.decay,
        # a constant schedule never decays: its length does not change the curve
        "scheduler.decay_steps": None if sched.decay == "constant" else max(decay_steps, sched.warmup_steps + 1),
        "training.global_batch_size": samples_per_step,
        **dpo_settings(config),  # a DPO run's objective and reference (nothing for other phases)
        **grpo_settings(config),  # a GRPO run's objective and sampling
        **{key: value for group in groups for key, value in group.settings().items()},
    }


def check_resume_settings(saved: dict[str, Any] | None, config: LoongForgeConfig, samples_per_step: int,
                          checkpoint: Any, groups: Sequence[ParameterGroup] = ()) -> bool:
    """Refuse resuming ``checkpoint`` (trained with ``saved``) under different settings unless the config overrides.

    Returns whether the schedule must be rebuilt from the new config (the settings differ and
    ``checkpoint.override_schedule`` is on); ``False`` when they agree. A checkpoint that recorded no settings
    (written before LoongForge 0.2) cannot be compared and resumes as before."""
    if saved is None:
        return False
    current = schedule_settings(config, samples_per_step, groups)
    # a group setting the checkpoint had and this config no longer sets is a change too
    dropped = [key for key in saved if key not in current and any(key.startswith(f"{g.key}.") for g in groups)]
    current.update(dict.fromkeys(dropped))
    changed = [key for key in current if not _same(saved.get(key), current[key])]
    if not changed:
        return False
    if config.checkpoint.override_schedule:
        return True
    listed = ", ".join(f"{key} {_shown(saved.get(key))} -> {_shown(current[key])}" for key in changed)
    hint = " (from training.steps)" if "scheduler.decay_steps" in changed and config.scheduler.decay_steps is None \
        else ""
    raise ConfigError(
        f"{config.source}: resuming {checkpoint} with different optimizer/schedule settings: {listed}{hint}; set "
        "checkpoint.override_schedule=true to continue with the new ones from the resumed step, restore the old "
        "values, or start fresh with checkpoint.resume=never"
    )


def _same(saved: Any, current: Any) -> bool:
    """Equal; numbers compare by value (a JSON round trip turns ``2`` into ``2`` and ``3e-4`` into ``0.0003``)."""
    if isinstance(saved, (int, float)) and isinstance(current, (int, float)):
        return float(saved) == float(current)
    return saved == current


def _shown(value: Any) -> str:
    if value is None:
        return "(unset)"
    return f"{value:g}" if isinstance(value, float) else str(value)
