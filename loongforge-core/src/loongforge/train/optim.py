"""megatron's optimizer and learning-rate scheduler from the run config.

The scheduler counts *samples* (megatron's convention, ``step(increment=global_batch_size)``), so warmup and
decay lengths given in steps are multiplied by the global batch size; a resumed run with the same batch size
continues the same curve. A model family's parameter groups
(:mod:`loongforge.models.parameter_groups`) become optimizer groups carrying their own peak and floor learning
rate and weight decay, which megatron's scheduler reads per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.models.parameter_groups import ParameterGroup, group_of

_DECAY_STYLES = ("cosine", "linear", "constant")


def build_optimizer(config: LoongForgeConfig, model_chunks: list[Any], *, params_dtype: str = "fp32",
                    groups: Sequence[ParameterGroup] = ()) -> Any:
    """AdamW over the model chunks (fp32 master weights and grads when parameters are bf16 or fp16); the tuned
    ``groups`` (the family's :meth:`~loongforge.models.family.ModelFamily.parameter_groups`) get their own settings."""
    settings = optimizer_config(config, params_dtype)
    overrides = group_overrides(config, settings, model_chunks, groups)
    extra = {} if overrides is None else {"config_overrides": overrides}  # megatron-core 0.15 has no such argument
    optimizer = get_megatron_optimizer(settings, model_chunks, **extra)
    fuse_cpu_adamw(optimizer)
    return optimizer


def group_overrides(config: LoongForgeConfig, settings: OptimizerConfig, model_chunks: list[Any],
                    groups: Sequence[ParameterGroup]) -> dict[Any, Any] | None:
    """megatron's per-parameter overrides for the tuned, trained ``groups`` on top of its standard ones (no weight
    decay on biases and norms); ``None`` (megatron's standard ones alone) when there are none. Parameters are
    matched by their TP=1/PP=1 names, resolved here once, so a group means the same parameters on every layout."""
    from loongforge.checkpoint.saver import unwrap_model
    from loongforge.parallel.init import global_parameters

    tuned = [group for group in groups if group.tuned and not group.frozen]
    if not tuned:
        return None
    try:  # per-parameter overrides arrived in megatron-core 0.16
        from megatron.core.optimizer import ParamKey, ParamPredicate, get_standard_config_overrides
        from megatron.core.optimizer_param_scheduler import ParamGroupOverride
    except ImportError as error:
        import megatron.core

        raise ConfigError(f"{tuned[0].key}: per-part lr/min_lr/weight_decay/unfreeze_at_step need megatron-core >= "
                          f"0.16 (installed: {megatron.core.__version__})") from error
    owner: dict[int, str] = {}
    for chunk in model_chunks:
        for name, param in global_parameters(unwrap_model(chunk)):
            group = group_of(name, groups)
            if group is not None:
                owner[id(param)] = group.name
    opt = config.optimizer
    overrides = get_standard_config_overrides(settings)
    for group in tuned:
        member = ParamPredicate(name=f"group:{group.name}",
                                fn=lambda param, name=group.name: owner.get(id(param)) == name)
        overrides[ParamKey(predicate=member)] = ParamGroupOverride(
            **group.scheduler_keys(opt.lr, opt.min_lr, opt.weight_decay))
    return overrides


def fuse_cpu_adamw(optimizer: Any) -> None:
    """Switch torch's AdamW inside megatron's optimizer to its fused kernel where the parameters are CPU tensors.

    Without Transformer Engine or Apex megatron falls back to ``torch.optim.AdamW`` with torch's defaults, and on
    CPU those pick the single-tensor path: about ten elementwise ops per parameter, each one pass over its
    memory. The fused CPU kernel does the whole update in one pass (measured 10x less CPU time for a 3M-parameter
    model, the step's largest avoidable cost against a plain loop). Only the kernel changes, not the maths: the
    same decoupled weight decay and bias correction. The choice is a parameter-group setting, which a checkpoint
    stores and loading restores, so the engine applies it again after a load (checkpoints written before it
    existed say ``fused: None``).
    """
    for group in optimizer.param_groups:
        on_cpu = all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"])
        if on_cpu and "fused" in group:  # torch's Adam/AdamW groups carry the key; other optimizers keep theirs
            group["fused"], group["foreach"] = True, False


def optimizer_config(config: LoongForgeConfig, params_dtype: str) -> OptimizerConfig:
    """megatron's optimizer settings for the run: AdamW, clipping, the distributed optimizer, and for fp16
    parameters megatron's fp16 optimizer with the loss scaler ``optimizer.loss_scale`` asks for (fixed, or
    dynamic with its initial value, floor and growth window). The device refuses fp16 where it cannot run it
    (``DeviceBackend.megatron_settings``) and pre-flight refuses unusable scaling values, before anything is built
    (:mod:`loongforge.train.preflight`)."""
    opt = config.optimizer
    if opt.name.lower() not in ("adamw", "adam"):
        raise ConfigError(f"{config.source}: optimizer.name '{opt.name}' is not supported (use adamw)")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(params_dtype)
    fp16 = params_dtype == "fp16"
    return OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        adam_eps=opt.eps,
        clip_grad=opt.grad_clip,
        bf16=params_dtype == "bf16",
        fp16=fp16,
        params_dtype=half or torch.float32,
        loss_scale=opt.loss_scale if fp16 else None,
        initial_loss_scale=opt.initial_loss_scale,
        min_loss_scale=opt.min_loss_scale,
        loss_scale_window=opt.loss_scale_window,
        use_distributed_optimizer=config.parallel.distributed_optimizer,
    )


class PartScheduler(OptimizerParamScheduler):
    """megatron's schedule, with a group's learning rate held at 0 until its ``unfreeze_at_step`` has passed.

    Why a learning rate of 0 and not a frozen group that joins the optimizer later: the group's parameters are in
    the optimizer (and in DDP's gradient buffers) from the first step, so the optimizer's groups, its state and the
    checkpoint format never change shape at the boundary, and where a run stands is the scheduler's sample count
    alone -- a run resumed on either side of the boundary continues bit-exactly, with nothing rebuilt. Before the
    boundary AdamW's update and its decoupled decay are both scaled by the learning rate, so the parameters stay
    bitwise unchanged while their gradients are computed and their moments kept (the price: the part's backward
    runs, and its gradients count in the clipped norm; ``frozen`` spares both but never trains). The boundary is
    counted in updates, like the schedule: an update the health screen left out does not move it.
    """

    def __init__(self, optimizer: Any, *, samples_per_step: int, **schedule: Any) -> None:
        self.samples_per_step = samples_per_step  # read by get_lr, which megatron's constructor already calls
        super().__init__(optimizer, **schedule)

    def get_lr(self, param_group: dict) -> float:
        if self.num_steps < param_group.get("unfreeze_at_step", 0) * self.samples_per_step:
            return 0.0
        return super().get_lr(param_group)


def build_scheduler(config: LoongForgeConfig, optimizer: Any, global_batch_size: int) -> PartScheduler:
    """Linear warmup to ``optimizer.lr``, then cosine/linear/constant decay to ``optimizer.min_lr``; a group carrying
    its own ``max_lr``/``min_lr``/``start_wd`` follows the same curve between its own values."""
    sched, opt = config.scheduler, config.optimizer
    if sched.decay not in _DECAY_STYLES:
        raise ConfigError(
            f"{config.source}: scheduler.decay must be one of {', '.join(_DECAY_STYLES)}, got '{sched.decay}'"
        )
    if opt.min_lr > opt.lr:
        raise ConfigError(f"{config.source}: optimizer.min_lr ({opt.min_lr}) is above optimizer.lr ({opt.lr})")
    decay_steps = sched.decay_steps if sched.decay_steps is not None else config.training.steps
    # megatron requires warmup < decay; a short smoke run with the default warmup then only warms up.
    decay_steps = max(decay_steps, sched.warmup_steps + 1)
    return PartScheduler(
        optimizer,
        samples_per_step=global_batch_size,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.warmup_steps * global_batch_size,
        lr_decay_steps=decay_steps * global_batch_size,
        lr_decay_style=sched.decay,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps * global_batch_size,
        wd_incr_style="constant",
    )
