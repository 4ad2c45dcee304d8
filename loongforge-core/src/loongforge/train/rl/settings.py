"""The ``grpo:`` section resolved and checked: what ``loongforge check`` and ``train`` refuse before anything is
built, and what a checkpoint records so that a resumed run trains the same objective.

Torch-free (the pre-flight imports it). Why each refusal: each would otherwise train something other than what was
asked, or fail deep inside a step -- a group of one reply (its advantage is always 0: nothing is learnt), replies
that cannot fit beside their prompt, a pipeline-parallel model (replies are sampled through the whole model on each
rank), context parallelism or packing (a reply's tokens must stay in one row), or a KL reference of adapters that do
not exist.
"""

from __future__ import annotations

import math
from typing import Any

from loongforge.config.schema import GRPOConfig, LoongForgeConfig
from loongforge.config.sections import origin_of
from loongforge.errors import ConfigError

#: The ``training.phase`` that trains with rewards.
PHASE = "grpo"


def is_rl_run(config: LoongForgeConfig) -> bool:
    return config.training.phase == PHASE


def reference_kind(config: LoongForgeConfig) -> str:
    """The KL term's reference: ``none`` without a KL term, else ``grpo.reference`` with ``auto`` resolved."""
    options = config.grpo
    if options.kl_coeff == 0:
        return "none"
    if options.reference != "auto":
        return options.reference
    return "adapters_off" if config.model.lora is not None else "frozen_copy"


def check_grpo(config: LoongForgeConfig, engine: str) -> list[str]:
    """Refuse a ``grpo:`` section outside ``training.phase: grpo`` and settings that cannot work, each in one line
    naming the file and key; for a GRPO run, what was resolved (one line)."""
    options = config.grpo
    if not is_rl_run(config):
        if options != GRPOConfig():
            raise ConfigError(f"{origin_of(config.source, 'grpo')}: the grpo section applies to training.phase grpo; "
                              f"this run's phase is '{config.training.phase}' (remove grpo: or set the phase)")
        return []

    def refuse(key: str, what: str) -> ConfigError:
        return ConfigError(f"{origin_of(config.source, key)}: {key}: {what}")

    if engine != "megatron":
        raise refuse("training.phase", f"grpo trains language models (megatron engine); model "
                                       f"'{config.model.name}' trains a task of its own")
    for key, value, ok, what in (
        ("grpo.group_size", options.group_size, options.group_size >= 2, "an integer >= 2 (advantages compare a "
                                                                         "prompt's replies)"),
        ("grpo.max_new_tokens", options.max_new_tokens, 1 <= options.max_new_tokens < config.data.seq_length,
         f"an integer in [1, data.seq_length {config.data.seq_length})"),
        ("grpo.updates_per_step", options.updates_per_step, options.updates_per_step >= 1, "an integer >= 1"),
        ("grpo.log_samples", options.log_samples, options.log_samples >= 0, "an integer >= 0"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not ok:
            raise refuse(key, f"must be {what}, got {value!r}")
    for key, value, ok, what in (
        ("grpo.clip_low", options.clip_low, 0 <= options.clip_low < 1, "in [0, 1)"),
        ("grpo.clip_high", options.clip_high, options.clip_high >= 0, ">= 0"),
        ("grpo.kl_coeff", options.kl_coeff, options.kl_coeff >= 0, ">= 0"),
        ("grpo.rollout_correction_cap", options.rollout_correction_cap, options.rollout_correction_cap >= 1,
         ">= 1"),
    ):
        if not math.isfinite(value) or not ok:
            raise refuse(key, f"must be a finite number {what}, got {value!r}")
    parallel = config.parallel
    if parallel.pp > 1:
        raise refuse("parallel.pp", "grpo samples replies through the whole model on each rank; use tp and dp")
    if parallel.cp > 1:
        raise refuse("parallel.cp", "grpo keeps each reply in one row; context parallelism splits it (use cp 1)")
    if config.data.pack:
        raise refuse("data.pack", "grpo samples each reply into its own row; set data.pack false")
    if config.training.loss_normalization != "micro_batch":
        raise refuse("training.loss_normalization", "grpo aggregates its token losses itself (grpo.loss_aggregation);"
                                                    " leave it at micro_batch")
    reference = reference_kind(config)
    if reference == "adapters_off" and config.model.lora is None:
        raise refuse("grpo.reference", "adapters_off needs model.lora (the reference is the model with its adapters "
                                       "off); use frozen_copy or auto")
    if config.grpo.updates_per_step > 1:
        per_rank = config.training.global_batch_size or config.training.micro_batch_size
        if per_rank % config.grpo.updates_per_step:
            raise refuse("grpo.updates_per_step", f"must divide the step's prompts ({per_rank}: "
                                                  "training.global_batch_size) into equal mini-batches")
    return [f"grpo: {options.group_size} replies per prompt, up to {options.max_new_tokens} tokens, reward "
            f"{options.reward or 'per prompt'}, KL {options.kl_coeff:g} (reference {reference}), "
            f"{options.loss_aggregation}, {options.updates_per_step} update(s) per step"]


def grpo_settings(config: LoongForgeConfig) -> dict[str, Any]:
    """What a GRPO checkpoint records (:mod:`loongforge.train.resume_settings`): the objective and the sampling;
    empty for other phases."""
    if not is_rl_run(config):
        return {}
    options = config.grpo
    return {
        "grpo.group_size": options.group_size,
        "grpo.max_new_tokens": options.max_new_tokens,
        "grpo.rollout": options.rollout,
        "grpo.reward": options.reward,
        "grpo.clip_low": options.clip_low,
        "grpo.clip_high": options.clip_high,
        "grpo.kl_coeff": options.kl_coeff,
        "grpo.reference": reference_kind(config),
        "grpo.loss_aggregation": options.loss_aggregation,
        "grpo.scale_advantages": options.scale_advantages,
        "grpo.updates_per_step": options.updates_per_step,
        "grpo.routing_replay": options.routing_replay,
    }
