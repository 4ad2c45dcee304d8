"""The ``dpo:`` section resolved and checked: what ``loongforge check`` and ``train`` refuse before anything is built,
and what a checkpoint records so that a resumed run trains the same objective.

Torch-free (the pre-flight imports it). Why each refusal: every one of them would otherwise train something other
than what was asked without a word -- a SimPO run that silently kept a reference model, a "reference" of adapters
that do not exist, a loss averaged over tokens where DPO's is over pairs, or pairs split across context-parallel
ranks or packed rows, where the sequence log-prob of a response is not one row's sum.
"""

from __future__ import annotations

import math
from typing import Any

from loongforge.config.schema import DPOConfig, LoongForgeConfig
from loongforge.config.sections import origin_of
from loongforge.errors import ConfigError

#: The ``training.phase`` that trains preference pairs.
PHASE = "dpo"
#: What ``dpo.reference`` resolves to (``auto`` is one of these once the run is known).
REFERENCES = ("frozen_copy", "adapters_off", "none")
#: Loss types whose log-probs are length-normalised unless ``dpo.length_normalization`` says otherwise (as TRL).
AVERAGED_BY_DEFAULT = ("ipo", "simpo")


def is_preference_run(config: LoongForgeConfig) -> bool:
    return config.training.phase == PHASE


def reference_kind(config: LoongForgeConfig) -> str:
    """``dpo.reference`` with ``auto`` resolved: ``none`` for SimPO, ``adapters_off`` under LoRA, else a frozen copy."""
    chosen = config.dpo.reference
    if chosen != "auto":
        return chosen
    if config.dpo.loss_type == "simpo":
        return "none"
    return "adapters_off" if config.model.lora is not None else "frozen_copy"


def length_normalized(options: DPOConfig) -> bool:
    """Whether responses are scored by their mean rather than summed token log-probs."""
    if options.length_normalization is not None:
        return options.length_normalization
    return options.loss_type in AVERAGED_BY_DEFAULT


def reference_forward_share(config: LoongForgeConfig) -> float:
    """The reference's share of a step's model FLOPs, next to the policy's forward and backward (three forwards):
    a third when it runs every step, nothing when precomputed or absent."""
    on_the_fly = reference_kind(config) != "none" and not config.dpo.precompute_reference
    return 1 / 3 if on_the_fly else 0.0


def check_dpo(config: LoongForgeConfig, engine: str) -> list[str]:
    """Refuse a ``dpo:`` section outside ``training.phase: dpo`` and DPO settings that cannot work, each in one line
    naming the file and key; for a DPO run, what was resolved (one line)."""
    options = config.dpo
    if not is_preference_run(config):
        if options != DPOConfig():
            raise ConfigError(f"{origin_of(config.source, 'dpo')}: the dpo section applies to training.phase dpo; "
                              f"this run's phase is '{config.training.phase}' (remove dpo: or set the phase)")
        return []

    def refuse(key: str, what: str) -> ConfigError:
        return ConfigError(f"{origin_of(config.source, key)}: {key}: {what}")

    if engine != "megatron":
        raise refuse("training.phase", f"dpo trains language models (megatron engine); model "
                                       f"'{config.model.name}' trains a task of its own")
    for key, value, ok, what in (
        ("dpo.beta", options.beta, options.beta > 0, "a finite number > 0"),
        ("dpo.label_smoothing", options.label_smoothing, 0 <= options.label_smoothing < 0.5, "in [0, 0.5)"),
        ("dpo.gamma", options.gamma, options.gamma >= 0, "a finite number >= 0"),
    ):
        if not ok or not math.isfinite(value):
            raise refuse(key, f"must be {what}, got {value!r}")
    if options.label_smoothing and options.loss_type not in ("sigmoid", "simpo"):
        raise refuse("dpo.label_smoothing", f"applies to loss_type sigmoid and simpo, not {options.loss_type}")
    reference = reference_kind(config)
    if options.loss_type == "simpo" and reference != "none":
        raise refuse("dpo.reference", f"simpo has no reference model; got {reference} (use none or auto)")
    if reference == "adapters_off" and config.model.lora is None:
        raise refuse("dpo.reference", "adapters_off needs model.lora (the reference is the model with its adapters "
                                      "off); use frozen_copy or auto")
    if options.precompute_reference and reference == "none":
        raise refuse("dpo.precompute_reference", "there is no reference to precompute (dpo.reference resolves to "
                                                 "none)")
    if config.parallel.cp > 1:
        raise refuse("parallel.cp", "dpo scores whole responses per row; context parallelism splits them (use cp 1)")
    if config.data.pack:
        raise refuse("data.pack", "dpo keeps one response per row (a pair's chosen and rejected in one micro-batch); "
                                  "set data.pack false")
    if config.training.loss_normalization != "micro_batch":
        raise refuse("training.loss_normalization", "dpo averages its loss over pairs; leave it at micro_batch")
    norm = "mean" if length_normalized(options) else "sum"
    return [f"dpo: loss {options.loss_type}, beta {options.beta:g}, reference {reference}"
            f"{' (precomputed)' if options.precompute_reference else ''}, response log-prob {norm}"]


def dpo_settings(config: LoongForgeConfig) -> dict[str, Any]:
    """What a DPO checkpoint records (:mod:`loongforge.train.resume_settings`): the objective, with ``auto`` and
    the length normalisation resolved; empty for other phases."""
    if not is_preference_run(config):
        return {}
    options = config.dpo
    return {
        "dpo.loss_type": options.loss_type,
        "dpo.beta": options.beta,
        "dpo.label_smoothing": options.label_smoothing,
        "dpo.gamma": options.gamma if options.loss_type == "simpo" else None,
        "dpo.length_normalization": length_normalized(options),
        "dpo.reference": reference_kind(config),
    }
