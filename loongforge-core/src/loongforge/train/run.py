"""``run_training``: turn a config into a running :class:`~loongforge.train.trainer.Trainer`, and clean up after.

The order matters and is the point of this module:

1. optimizations named in the config are registered for the run, then plugins (those included) adjust the
   config (``loongforge_configure``);
2. the output and checkpoint directories are created and proved writable (:mod:`loongforge.train.writable`);
   the device backend is chosen (``--device`` > ``LOONGFORGE_DEVICE`` > ``device:``) and its environment and
   megatron patches are applied *before* anything is built;
3. process groups (torchrun or a world of one); the layout, model sizes and batch are validated before
   megatron's parallel groups are made; threads and seeds;
4. the step engine (:mod:`loongforge.train.engines`): for megatron, model chunks (flavor by name + overrides,
   weights independent of the layout) -> ``loongforge_modify_model`` -> megatron DDP -> optimizer -> data; for a
   task model, the task's model, data and AdamW (under a torch-native strategy with several processes);
5. the one learning-rate schedule, resume (newest valid checkpoint, RNG and data position included), the one loop
   (:mod:`loongforge.train.loop`) with SIGTERM/SIGUSR1 turned into a checkpoint and a stop while it runs
   (:mod:`loongforge.train.preemption`), the final checkpoint and the engine's after-training work (a text
   sample, a task's samples and scores).
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.plugins import get_host
from loongforge.resolve import decoder_flavor, model_label, registered_family, resolve_model_flavor
from loongforge.train.preference.settings import is_preference_run, reference_forward_share
from loongforge.train.preflight import preflight, requested_device
from loongforge.train.rl.settings import is_rl_run
from loongforge.train.writable import check_writable


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[loongforge] {message}", flush=True)


def _seed_everything(seed: int, backend: Any) -> None:
    """Seed every stream; pipeline stages get distinct seeds (megatron's convention) so that dropout differs
    per stage. Initial weights do not depend on these streams (:mod:`loongforge.parallel.init`)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    backend.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _wrap_ddp(model: list[Any], config: LoongForgeConfig, settings: Any) -> list[Any]:
    """megatron DDP: contiguous gradient buffers reduced over the data-parallel group once per step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        **{
            "grad_reduce_in_fp32": settings.params_dtype != "fp32",
            "overlap_grad_reduce": False,
            "use_distributed_optimizer": config.parallel.distributed_optimizer,
            **settings.ddp_config_kwargs(),
        }
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(model)
    ]


def _connect_schedule(model: list[Any], optimizer: Any) -> None:
    """Give megatron's schedule the hooks it calls: loss scaling, gradient finalisation, no-sync."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = model[0].no_sync if len(model) == 1 else [chunk.no_sync for chunk in model]


def _validate(config: LoongForgeConfig, device: str | None, device_source: str) -> None:
    """Every pre-flight check -- exactly what ``loongforge check`` runs (:mod:`loongforge.train.preflight`) -- for
    this process's world, before any optimization, process group or model exists."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    preflight(config, nproc=world_size, device=device, device_source=device_source)


def run_training(config: LoongForgeConfig, *, device: str | None = None, device_source: str = "--device") -> dict:
    """Train as ``config`` says; return summary metrics (losses, steps, tokens/s, checkpoint, sample text)."""
    from loongforge.devices.selection import select_backend
    from loongforge.train.preemption import PreemptionWatch

    host = get_host()
    _validate(config, device, device_source)
    enabled = host.enable_optimizations(config.optimizations)
    # From here on a preemption signal is recorded, not fatal: one that lands while the model is still being built
    # (a Slurm warning too close to the start) is answered at the first step boundary like any other.
    watch = PreemptionWatch(enabled=config.checkpoint.save_on_signal)
    try:
        with watch:
            host.configure(config)
            check_writable(config, create=True)  # plugins may have moved them; every rank writes checkpoint files
            request, source = requested_device(config, device, device_source)
            backend, reason = select_backend(request, host.registry("device"), source=source)
            backend.configure_env()
            from loongforge.parallel.distributed import init_distributed, shutdown_distributed

            info = init_distributed(backend, timeout_s=config.distributed.timeout_s)
            try:
                return _run(config, host, backend, reason, info, watch)
            finally:
                shutdown_distributed(info)
    finally:
        for name in enabled:
            host.unregister(f"optimization:{name}")


def _task_of(config: LoongForgeConfig, host: Any) -> Any:
    """The task of a model the task engine trains (``engine == "task"``: its ``make_task``); ``None`` for a
    megatron-engine model (whose config pre-flight has refused any ``task:`` section)."""
    family = registered_family(config, host)
    return family.make_task(config) if family.engine == "task" else None


def _run(config: LoongForgeConfig, host: Any, backend: Any, reason: str, info: Any, watch: Any) -> dict:
    from loongforge.parallel.strategy import check_strategy
    from loongforge.train.batches import load_tokenizer

    _say(info.rank, f"device: {backend.name} ({reason})")
    backend.apply_patches()  # once, for every engine, before anything is built (a device plugin's patches)
    task = _task_of(config, host)
    if task is not None:  # a model with a task of its own: the task engine
        return _train(_build_task_trainer(config, task, host, backend, info), config, info, watch)
    # Everything that can be wrong with the layout, model sizes and batch fails here, before any group or model.
    where = f"parallel.strategy in {config.source}"
    strategy = check_strategy(host.registry("strategy").load(config.parallel.strategy, where=where),
                              config.parallel.strategy, "megatron", where, config.model.name)
    config, auto_decision = _resolve_auto_layout(config, host, backend, info)
    layout = strategy.validate(config.parallel, info.world_size, config.source)
    model_flavor = resolve_model_flavor(config, host)
    # the layout against what the model family says it needs (ModelFamily.check_layout), as the pre-flight did
    plan = strategy.check_model(layout, model_flavor, config.training, config.source,
                                seq_length=config.data.seq_length)
    from loongforge.train.batches import check_pack

    check_pack(config, model_flavor.decoder, layout.cp)
    from loongforge.parallel.moe_overlap_check import check_moe_a2a_overlap

    overlap = check_moe_a2a_overlap(config, layout, model_flavor.decoder, backend)  # again: auto chose the layout
    from loongforge.config.chunk_settings import check_seq_chunks

    check_seq_chunks(config, model_flavor.decoder, cp=layout.cp, vpp=layout.vpp)
    tokenizer = load_tokenizer(host, config)
    settings = _device_settings(config, backend)
    _init_parallel(strategy, layout, config, backend, info)
    if overlap is not None:
        _say(info.rank, overlap)
    trainer = _build_trainer(config, host, backend, reason, layout, plan, model_flavor, tokenizer, info, settings,
                             auto_decision=auto_decision)
    return _train(trainer, config, info, watch)


def _resolve_auto_layout(config: LoongForgeConfig, host: Any, backend: Any, info: Any) -> tuple[Any, dict | None]:
    """``parallel: auto``: the planner's best layout for this world size written into a copy of the config,
    and the decision for the checkpoint metadata (see :mod:`loongforge.planner.auto`)."""
    if not config.parallel.auto:
        return config, None
    from loongforge.planner.auto import apply_plan, plan_for_run
    from loongforge.planner.report import explain

    result = plan_for_run(config, resolve_model_flavor(config, host), backend, info.world_size)
    if not result.ranked:
        raise ConfigError(f"{config.source}: parallel: auto: {result.infeasible_message()}")
    for line in explain(result):
        _say(info.rank, f"parallel: auto {line}")
    return apply_plan(config, result), result.decision()


def _device_settings(config: LoongForgeConfig, backend: Any) -> Any:
    """What the device adds to megatron's configs for ``training.precision`` and ``device_options``.

    The device plugin owns precision recipes (FP8 on CUDA) and switches (CUDA graphs, overlap); core only
    forwards them, so an unsupported request fails here with the device's reason, before any model exists.
    """
    try:
        return backend.megatron_settings(config.training.precision, **config.device_options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{config.source}: training.precision / device_options: {exc}") from None


def _init_parallel(strategy: Any, layout: Any, config: LoongForgeConfig, backend: Any, info: Any) -> None:
    """Create the parallel layout's process groups; set threads and seeds (which depend on the layout)."""
    strategy.initialize(layout)
    vpp = f" vpp={layout.vpp}" if layout.vpp else ""
    vpp += f" {layout.cp_description}" if layout.cp > 1 else ""
    ep = f" ep={layout.ep}" if layout.ep > 1 else ""
    _say(
        info.rank,
        f"parallel: tp={layout.tp} pp={layout.pp}{vpp}{ep} dp={layout.dp} "
        f"({info.launcher}, world size {info.world_size})",
    )
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    _seed_everything(config.run.seed, backend)


def _build_trainer(
    config: LoongForgeConfig,
    host: Any,
    backend: Any,
    reason: str,
    layout: Any,
    plan: Any,
    flavor: Any,
    tokenizer: Any,
    info: Any,
    settings: Any,
    auto_decision: dict | None = None,
) -> Any:
    """Model -> plugins' modify_model -> DDP -> optimizer -> data -> the megatron engine -> Trainer, resumed."""
    from megatron.core import parallel_state

    from loongforge.models.chunks import build_model_chunks
    from loongforge.train.batches import build_batches, validation_origin, validation_set
    from loongforge.train.checkpointing import RunCheckpoints, checkpoint_dir, run_metadata
    from loongforge.train.optim import build_optimizer

    global_batch, num_microbatches = plan.global_batch_size, plan.num_microbatches
    model = host.modify_model(build_model_chunks(flavor, config, backend, layout, settings), config)
    reference = None
    kind = run_reference_kind(config)
    if kind != "none":  # the starting weights, before DDP and any resume
        from loongforge.train.preference.reference import build_reference

        reference = build_reference(kind, model, lambda: build_model_chunks(flavor, config, backend, layout,
                                                                            settings))
    model = _wrap_ddp(model, config, settings)
    optimizer = build_optimizer(config, model, params_dtype=settings.params_dtype, groups=flavor.parameter_groups())
    _connect_schedule(model, optimizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    decoder = decoder_flavor(flavor)
    data, valid = build_batches(host, config, tokenizer, rank=info.rank, dp_rank=dp_rank, dp_size=layout.dp,
                                model=flavor, num_microbatches=num_microbatches,
                                dp_group=parallel_state.get_data_parallel_group())
    validation = validation_set(config, valid, global_batch) if config.evaluation.interval else None
    if validation is not None:
        _say(info.rank, f"evaluation: every {config.evaluation.interval} steps on {validation.batches} global "
                        f"batch(es) of {validation_origin(config)}")
    n_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    _say(
        info.rank,
        f"model: {model_label(config, flavor)} ({n_params / 1e6:.2f}M parameters on this rank), "
        f"global batch {global_batch} x {config.data.seq_length} tokens, {num_microbatches} micro-batches/step",
    )
    if config.model.recompute is not None:
        _say(info.rank, f"activation recompute: {config.model.recompute}")
    offload = _activation_offload(config, model, decoder, backend, info.rank)
    metadata = run_metadata(backend, reason, layout, info.world_size, config.model.name)
    if auto_decision is not None:  # what parallel: auto chose and why, next to the device choice
        metadata["parallel_auto"] = auto_decision
    checkpoints = checkpoint_dir(config)
    engine = _megatron_engine(
        config,
        reference,
        host,
        tokenizer,
        model=model,
        optimizer=optimizer,
        data=data,
        num_microbatches=num_microbatches,
        global_batch_size=global_batch,
        checkpoints=RunCheckpoints(checkpoints, config, host, backend, metadata, flavor.parameter_groups()),
        extra_inputs=flavor.extra_inputs,
        sample=lambda chunks: _sample(chunks, decoder, tokenizer, config, info.rank),
        validation=validation,
        flops_per_step=_model_flops_per_step(config, flavor, backend, global_batch),
        score_tasks=_task_scorer(config, decoder, tokenizer),
        offload=offload,
    )
    trainer = _trainer_for(engine, checkpoints, config, host, backend, info.rank)
    _resume(trainer, info.rank)
    return trainer


def _activation_offload(config: LoongForgeConfig, model: list[Any], decoder: Any, backend: Any, rank: int) -> Any:
    """``training.offload_activations`` installed on this rank's chosen decoder layers, or None."""
    options = config.training.offload_activations
    if options is None:
        return None
    from loongforge.config.offload_settings import offloaded_layer_indices
    from loongforge.train.activation_offload import ActivationOffload, offload_targets

    chosen = offloaded_layer_indices(options, decoder.num_layers, config.source)
    offload = ActivationOffload(offload_targets(model, chosen), backend, options.min_bytes)
    _say(rank, f"activation offload: {offload.num_layers} layer(s) on this rank, saved storages of >= "
               f"{options.min_bytes} bytes to host memory")
    return offload


def _task_scorer(config: LoongForgeConfig, decoder: Any, tokenizer: Any) -> Any:
    """``evaluation.tasks``' scorer of the model chunk (:func:`loongforge.evaluation.harness.task_scores`), or None."""
    if not config.evaluation.tasks:
        return None
    from loongforge.evaluation.harness import task_scores

    limit = config.evaluation.tasks_limit or None
    return lambda chunk: task_scores(chunk, tokenizer, decoder, config.evaluation.tasks, limit=limit)


def run_reference_kind(config: LoongForgeConfig) -> str:
    """The reference model the run's phase needs (``none`` for pretraining and SFT)."""
    if is_preference_run(config):
        from loongforge.train.preference.settings import reference_kind

        return reference_kind(config)
    if is_rl_run(config):
        from loongforge.train.rl.settings import reference_kind

        return reference_kind(config)
    return "none"


def _megatron_engine(config: LoongForgeConfig, reference: Any, host: Any, tokenizer: Any, **engine: Any) -> Any:
    """The megatron step engine: the language-model one; for ``training.phase: dpo`` the preference engine with the
    ``dpo:`` section's objective and the ``reference`` built for it; for ``grpo`` the policy-gradient engine with
    the ``grpo:`` section's objective, the rewards its prompts name and the KL term's ``reference``."""
    from loongforge.train.engines.megatron import MegatronEngine

    if is_preference_run(config):
        from loongforge.train.preference.engine import PreferenceEngine
        from loongforge.train.preference.objective import PreferenceObjective

        return PreferenceEngine(objective=PreferenceObjective.of(config.dpo), reference=reference,
                                precompute=config.dpo.precompute_reference, config=config, **engine)
    if is_rl_run(config):
        from loongforge.train.rl.engine import PolicyGradientEngine
        from loongforge.train.rl.objective import PolicyObjective
        from loongforge.train.rl.rewards import resolve_rewards

        prompts = engine["data"].dataset
        validation = engine["validation"]
        rewards = resolve_rewards(config, host, [*prompts.prompts, *(validation.rows.prompts if validation else [])])
        return PolicyGradientEngine(objective=PolicyObjective.of(config.grpo), options=config.grpo, rewards=rewards,
                                    reference=reference, tokenizer=tokenizer, config=config, **engine)
    return MegatronEngine(config=config, **engine)


def _build_task_trainer(config: LoongForgeConfig, task: Any, host: Any, backend: Any, info: Any) -> Any:
    """The task engine (task model, optimizer, data order; a torch-native strategy for several processes) ->
    Trainer, resumed."""
    from loongforge.train.checkpointing import checkpoint_dir
    from loongforge.train.engines.task import TaskEngine

    engine = TaskEngine(config, task, backend, host, rank=info.rank, world_size=info.world_size)
    trainer = _trainer_for(engine, checkpoint_dir(config), config, host, backend, info.rank)
    _resume(trainer, info.rank)
    _say(info.rank, engine.describe())
    return trainer


def _model_flops_per_step(config: LoongForgeConfig, flavor: Any, backend: Any, global_batch: int) -> float | None:
    """The model FLOPs of one step of the resolved model ``flavor`` (the family's ``flops_per_token`` and the FLOPs
    of the parts it adds outside its decoder), which the metrics' ``tflops`` and ``mfu`` divide by the step time;
    ``None`` when the family does not count them."""
    from loongforge.planner.auto import kernels_of, workload_for
    from loongforge.train.throughput import model_flops_per_step

    workload = workload_for(config, flavor, kernels_of(backend))
    if is_rl_run(config):
        # GRPO: every reply trained, plus the recompute pass and the reference's (a third each); the rollout's
        # forwards are timed apart (time/rollout_s), not counted
        flops = model_flops_per_step(workload, config.grpo.group_size * global_batch)
        passes = 1 + (1 + (config.grpo.kl_coeff > 0)) / 3
        return flops * passes if flops is not None else None
    if not is_preference_run(config):
        return model_flops_per_step(workload, global_batch)
    # DPO: both sequences of every pair trained, and a forward (a third of it) through the reference each step
    flops = model_flops_per_step(workload, 2 * global_batch)
    return flops * (1 + reference_forward_share(config)) if flops is not None else None


def _trainer_for(engine: Any, checkpoints: Any, config: LoongForgeConfig, host: Any, backend: Any,
                 rank: int) -> Any:
    """The Trainer hooks see, with the one learning-rate schedule over the engine's parameter groups."""
    from loongforge.train.optim import build_scheduler
    from loongforge.train.trainer import Trainer

    scheduler = build_scheduler(config, engine.optimizer, engine.samples_per_step)
    return Trainer(config=config, host=host, backend=backend, engine=engine, scheduler=scheduler,
                   checkpoints=checkpoints, rank=rank)


def _resume(trainer: Any, rank: int) -> None:
    from loongforge.train.checkpointing import resume_checkpoint

    resumed = resume_checkpoint(trainer)
    if resumed is not None:
        _say(rank, f"resumed from {resumed} at step {trainer.step}")


def _train(trainer: Any, config: LoongForgeConfig, info: Any, watch: Any) -> dict:
    """The loop with its metrics sinks, progress display and preemption signals, the engine's after-training work
    (a text sample, a task's samples and scores: their pictures reach the trackers, which close after it),
    ``on_train_end`` and the closing report."""
    from loongforge.config.loader import config_to_dict
    from loongforge.parallel.distributed import start_heartbeat
    from loongforge.train.loop import fit
    from loongforge.train.metrics import MetricsWriter
    from loongforge.train.progress import ProgressDisplay
    from loongforge.train.trackers import Trackers, open_trackers

    rank = info.rank

    if trainer.step >= config.training.steps:
        _say(rank, f"nothing to do: already at step {trainer.step} of {config.training.steps}")
    log = config.logging
    trackers = open_trackers(config, start_step=trainer.step) if rank == 0 else Trackers()
    metrics = MetricsWriter(config.run.output_dir, rank=rank, jsonl=log.jsonl, trackers=trackers,
                            start_step=trainer.step)
    locations = trackers.locations()
    try:
        metrics.hparams(config_to_dict(config))
        trainer.media = trackers
        progress = ProgressDisplay(config.training.steps, start_step=trainer.step, rank=rank, enabled=log.progress)
        watch.connect(world_size=info.world_size, device=trainer.backend.device(info.local_rank))
        heartbeat = start_heartbeat(info, config.distributed.timeout_s)  # finds a hung rank (several processes)
        try:
            summary = fit(trainer, metrics, progress, watch, heartbeat=heartbeat)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
        summary.update(trainer.engine.finish(trainer))
    finally:
        metrics.close()
    summary["metrics_file"] = str(metrics.jsonl_path) if log.jsonl else None
    summary["trackers"] = locations
    summary["tensorboard_dir"] = str(metrics.output_dir / "tensorboard") if "tensorboard" in locations else None
    trainer.host.on_train_end(trainer=trainer, metrics=summary)
    _report(summary, rank)
    return summary


def _sample(model: list[Any], flavor: Any, tokenizer: Any, config: LoongForgeConfig, rank: int) -> str | None:
    """A short continuation of ``training.sample_prompt`` (every TP rank runs the forward; rank 0 prints)."""
    from megatron.core import parallel_state

    n = config.training.sample_tokens
    if n <= 0:
        return None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        _say(rank, "sample skipped: text generation does not support pipeline parallelism yet")
        return None
    if parallel_state.get_context_parallel_world_size() > 1:
        _say(rank, "sample skipped: text generation does not support context parallelism yet")
        return None
    from loongforge.checkpoint.saver import unwrap_model
    from loongforge.models.generate import generate_text

    text = generate_text(
        unwrap_model(model[0]),
        tokenizer,
        config.training.sample_prompt,
        n,
        max_positions=min(config.data.seq_length, flavor.max_position_embeddings),
        temperature=0.8,
        top_k=40,
        seed=config.run.seed,
    )
    _say(rank, f"sample:\n{text}")
    return text


def _report(summary: dict, rank: int) -> None:
    if summary["final_loss"] is not None:
        speed = (f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary
                 else f"{summary['samples_per_s']:,.1f} samples/s")
        if "tflops" in summary:  # the model's FLOP rate per device, and against the device's peak where known
            speed += f", {summary['tflops']:.3g} TFLOP/s per device"
            speed += f" (MFU {summary['mfu']:.1%})" if "mfu" in summary else ""
        steps = f"{summary['steps_this_run']} steps"
        if summary["steps_this_run"] != summary["steps"]:  # resumed: the steps before were another process's
            steps += f" this run ({summary['steps']} of {summary['steps_total']} total)"
        _say(rank, f"done: {steps}, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, {speed}")
    if summary.get("compiled_modules"):  # training.compile (either engine)
        modules = ", ".join(f"{count} {name}" for name, count in summary["compiled_modules"].items())
        _say(rank, f"compile: {summary['compile']} ({modules}; {summary['compile_graphs']} graph(s), "
                   f"{summary['compile_s']:.1f} s)")
    if summary.get("memory_mib"):  # this rank's memory by component (megatron engine)
        _say(rank, "memory (MiB): " + ", ".join(f"{name} {mib:,.1f}" for name, mib in summary["memory_mib"].items()))
    if summary.get("activation_mib"):
        _say(rank, "activations per micro-batch (MiB, saved for backward): "
             + ", ".join(f"{name} {mib:,.1f}" for name, mib in summary["activation_mib"].items()))
    if "val_loss" in summary:
        _say(rank, "validation: " + ", ".join(f"{key.removeprefix('val_')} {value:.4f}"
                                              for key, value in summary.items() if key.startswith("val_")))
    if summary["checkpoint_dir"]:
        _say(rank, f"checkpoint: {summary['checkpoint_dir']}")
    if summary["metrics_file"]:
        _say(rank, f"metrics: {summary['metrics_file']}")
    for name, where in summary["trackers"].items():
        _say(rank, f"{name}: {where}")
