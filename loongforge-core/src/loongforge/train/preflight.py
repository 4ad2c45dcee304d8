"""Every check a run's config must pass before anything is built: what ``loongforge check`` reports and what
``loongforge train`` runs first, so that the two can never disagree.

Why one module: a wrong setting should fail in one line naming the file and key while nothing heavy exists yet --
not after minutes of model building, and not as a traceback from deep inside megatron-core. The checks build no
model and no process group and do not import megatron-core (torch only where a registered object's module needs
it: a torch-native strategy, a tokenizer). In order:

1. loop settings (:func:`loongforge.train.loop.validate_loop_settings`), the loss normalisation, the optimizer
   and schedule values (a NaN, infinite or negative learning rate would train garbage rather than fail) and the
   run's other numbers (seed, threads, batch sizes, sample length, validation share, ``evaluation:``);
2. the model family resolves, with its parts and ``model.overrides`` (unknown fields with did-you-mean, types);
3. every name the run uses resolves (device, strategy, dataset and tokenizer for megatron models, optimizations);
4. the plugin-owned sections against their declared dataclasses (:mod:`loongforge.config.plugin_sections`):
   ``task:``, ``device_options:`` (for the selected device backend), ``optimizations.<name>:``;
5. the layout against the world size through the strategy (batch sizes; what the layout needs from the model --
   heads, query groups, layers, experts against tp/pp/cp/ep -- is the family's ``check_layout``), precision and
   device options through the device backend, LoRA limits;
6. files and directories the config names exist (``data.paths``, ``model.load`` -- a Hugging Face directory must
   describe this model --, ``checkpoint.resume``, a task's paths), the tokenizer fits the vocabulary and
   ``data.seq_length`` the positions; for a megatron model the data opens as training opens it
   (:func:`loongforge.train.batches.open_dataset`: headers, sizes, malformed lines, token ids against the
   vocabulary) and holds a training sample -- and, when it evaluates, validation rows (the held-out split or
   ``evaluation.data``) for at least one global batch; the output and checkpoint directories can be written
   (:mod:`loongforge.train.writable`).

Part of :mod:`loongforge.train` (whose run calls it first) rather than of :mod:`loongforge.config`: it asks the
strategies, devices, the loop and the tokenizers, all of which read the config, so inside ``config`` it would tie the
subpackages into an import cycle.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.config.plugin_sections import device_options, task_options
from loongforge.config.schema import AUTO_RESUMES, LOSS_NORMALIZATIONS, LoongForgeConfig
from loongforge.config.sections import COMMAND_LINE, convert, named_paths, origin_of, unknown_key_error
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.optimizations import check_optimization, optimization_options
from loongforge.parallel.strategy import check_strategy
from loongforge.plugins import get_host
from loongforge.resolve import resolve_model_flavor
from loongforge.train.preference.settings import check_dpo
from loongforge.train.rl.settings import check_grpo, is_rl_run
from loongforge.train.writable import check_writable

#: Precisions the task engine trains in (parameters in fp32, bf16 autocast or FSDP2 mixed precision).
TASK_PRECISIONS = ("fp32", "bf16")
#: ``run.seed`` is below this: numpy's seeding takes 32-bit values and each pipeline stage adds 100 to the seed.
MAX_SEED = 2**31

if TYPE_CHECKING:
    from loongforge.devices.base import DeviceBackend, MegatronSettings
    from loongforge.models.family import ModelFamily
    from loongforge.plugins import PluginHost


def preflight(config: LoongForgeConfig, *, nproc: int | None = None, device: str | None = None,
              device_source: str = "--device") -> list[str]:
    """Run every check for a world of ``nproc`` processes (default 1); return what was resolved, one line each.
    ``device`` is a request from ``device_source`` (else ``LOONGFORGE_DEVICE``, else the config's ``device:``)."""
    from loongforge.devices.selection import select_backend
    from loongforge.resolve import resolve_names

    host = get_host()
    _located(config, lambda: resolve_names(config))  # every name given must resolve, used or not (as train's CLI)
    request, source = requested_device(config, device, device_source)
    backend, _ = _located(config, lambda: select_backend(request, host.registry("device"), source=source))
    return check_run(config, world_size=nproc or 1, backend=backend, host=host)


def requested_device(config: LoongForgeConfig, device: str | None, device_source: str) -> tuple[str, str]:
    """The device request and where it came from: the CLI flag, then ``LOONGFORGE_DEVICE``, then the config."""
    if device:
        return device, device_source
    if os.environ.get("LOONGFORGE_DEVICE"):
        return os.environ["LOONGFORGE_DEVICE"], "LOONGFORGE_DEVICE"
    return config.device or "auto", f"device in {config.source}"


def check_run(config: LoongForgeConfig, *, world_size: int, backend: DeviceBackend,
              host: PluginHost | None = None) -> list[str]:
    """Every check for ``world_size`` processes on ``backend`` (what resolved, one line each); a one-line
    :class:`ConfigError` naming the file for the first that fails."""
    host = host or get_host()
    return _located(config, lambda: _check(config, world_size, backend, host))


def _check(config: LoongForgeConfig, world_size: int, backend: DeviceBackend, host: PluginHost) -> list[str]:
    from loongforge.train.loop import validate_loop_settings

    validate_loop_settings(config)
    _check_loss_normalization(config)
    _check_hyperparameters(config)
    _check_freeze(config)
    if config.model.overrides:  # against the model they apply to: the family with its parts, before overrides
        bare = dataclasses.replace(config, model=dataclasses.replace(config.model, overrides={}))
        _check_override_types(resolve_model_flavor(bare, host), config)
    family = resolve_model_flavor(config, host)
    for group in family.parameter_groups():  # each group's floor against its peak, given optimizer.lr/min_lr
        group.peak_and_floor(config.optimizer.lr, config.optimizer.min_lr)
    lines = _names(config, family, backend, host)
    lines += check_dpo(config, family.engine)
    lines += check_grpo(config, family.engine)
    _check_optimizations(config, host)
    paths = [(f"data.paths[{i}]", p) for i, p in enumerate(config.data.paths)] if family.engine == "megatron" else []
    paths += [(f"evaluation.data[{i}]", p) for i, p in enumerate(config.evaluation.data)]
    options = task_options(family, config)
    global_batch = None
    if family.engine == "task":
        _check_task_model_keys(config, family)
        paths += named_paths(options, "task") if options is not None else []
        device_options(backend, config)
        lines.append(_check_task_layout(config, world_size, host))
        from loongforge.tasks import check_task_parallel

        if config.parallel.cp > 1 or config.parallel.tp > 1:
            check_task_parallel(family.make_task(config), config)
    else:
        from loongforge.train.batches import check_validation_source

        check_validation_source(config)
        checked, global_batch = _check_megatron(config, world_size, family, backend, host)
        lines += checked
    _check_paths(config, paths)
    if family.engine == "megatron":
        lines += _check_dataset(config, family, host, global_batch)
    else:
        from loongforge.train.task_sizes import data_parallel

        # the engine's dp: ranks / (context x tensor parallel)
        with data_parallel(world_size // max(config.parallel.cp * config.parallel.tp, 1)):
            lines += family.check_task(config, options)
    check_writable(config, create=False)  # run.output_dir and the checkpoint root, without creating them
    return lines


def _located(config: LoongForgeConfig, run: Any) -> Any:
    """``run()``, with a failure that names neither the config file nor the command line (a plugin's own message)
    prefixed by the file."""
    try:
        return run()
    except LoongForgeError as exc:
        if config.source in str(exc) or COMMAND_LINE in str(exc):
            raise
        raise ConfigError(f"{config.source}: {exc}") from None


def _keyed(config: LoongForgeConfig, key: str, run: Any) -> Any:
    """``run()``, with a failure that does not name ``key`` prefixed by the file and the key."""
    try:
        return run()
    except LoongForgeError as exc:
        if key in str(exc):
            raise
        raise ConfigError(f"{origin_of(config.source, key)}: {key}: {exc}") from None


def _check_loss_normalization(config: LoongForgeConfig) -> None:
    value = config.training.loss_normalization
    if value not in LOSS_NORMALIZATIONS:
        where = origin_of(config.source, "training.loss_normalization")
        raise ConfigError(f"{where}: training.loss_normalization must be one of {', '.join(LOSS_NORMALIZATIONS)}, "
                          f"got '{value}'")


def _check_freeze(config: LoongForgeConfig) -> None:
    """A ``model.freeze`` pattern that matches every name (only ``*``) leaves nothing to train, whatever the model:
    said before it is built (a subtler freeze-all is found when the patterns meet the built model, before any
    step)."""
    everything = [pattern for pattern in config.model.freeze if pattern and set(pattern) == {"*"}]
    if everything:
        key = "model.freeze"
        raise ConfigError(f"{origin_of(config.source, key)}: {key} pattern '{everything[0]}' freezes every parameter: "
                          "nothing would train (name the parts to freeze, e.g. 'encoder.*')")


def _check_hyperparameters(config: LoongForgeConfig) -> None:
    """Optimizer, schedule and run values in range (the types are checked when the config loads): each would
    otherwise be ignored, train garbage, or fail deep inside torch or numpy."""
    opt, sched, t = config.optimizer, config.scheduler, config.training
    if opt.name.lower() not in ("adamw", "adam"):
        raise ConfigError(f"{origin_of(config.source, 'optimizer.name')}: optimizer.name '{opt.name}' is not "
                          "supported (use adamw)")
    rules = (  # (key, value, within range -- given it is a finite number --, what it must be)
        ("optimizer.lr", opt.lr, opt.lr >= 0, "a finite number >= 0"),  # 0: weights stay (parity and load checks)
        ("optimizer.min_lr", opt.min_lr, 0 <= opt.min_lr <= opt.lr, f"a finite number >= 0 and <= optimizer.lr "
                                                                      f"({opt.lr})"),
        ("optimizer.weight_decay", opt.weight_decay, opt.weight_decay >= 0, "a finite number >= 0"),
        ("optimizer.beta1", opt.beta1, 0 <= opt.beta1 < 1, "in [0, 1)"),
        ("optimizer.beta2", opt.beta2, 0 <= opt.beta2 < 1, "in [0, 1)"),
        ("optimizer.eps", opt.eps, opt.eps > 0, "a finite number > 0"),
        ("optimizer.grad_clip", opt.grad_clip, opt.grad_clip >= 0, "a finite number >= 0 (0 disables clipping)"),
        # fp16's loss scaler (checked whatever the precision, so a recipe switched to fp16 later holds no surprise)
        ("optimizer.loss_scale", opt.loss_scale, opt.loss_scale is None or opt.loss_scale > 0,
         "a finite number > 0 (or null: dynamic loss scaling)"),
        ("optimizer.initial_loss_scale", opt.initial_loss_scale, opt.initial_loss_scale > 0, "a finite number > 0"),
        ("optimizer.min_loss_scale", opt.min_loss_scale, 0 < opt.min_loss_scale <= opt.initial_loss_scale,
         f"a finite number > 0 and <= optimizer.initial_loss_scale ({opt.initial_loss_scale})"),
        ("optimizer.loss_scale_window", opt.loss_scale_window, opt.loss_scale_window >= 1, "an integer >= 1"),
        ("scheduler.warmup_steps", sched.warmup_steps, sched.warmup_steps >= 0, "an integer >= 0"),
        ("scheduler.decay_steps", sched.decay_steps, sched.decay_steps is None or sched.decay_steps >= 1,
         "an integer >= 1 (or unset: training.steps)"),
        ("training.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 1, "an integer >= 1"),
        ("training.global_batch_size", t.global_batch_size, t.global_batch_size is None or t.global_batch_size >= 1,
         "an integer >= 1 (or unset: micro_batch_size * dp)"),
        ("training.threads", t.threads, t.threads is None or 1 <= t.threads < 2**31,
         "an integer >= 1 (or unset: torch's default)"),
        ("training.sample_tokens", t.sample_tokens, t.sample_tokens >= 0, "an integer >= 0 (0: no sample)"),
        ("run.seed", config.run.seed, 0 <= config.run.seed < MAX_SEED, f"an integer in [0, {MAX_SEED})"),
        ("data.valid_fraction", config.data.valid_fraction, 0 <= config.data.valid_fraction < 1, "in [0, 1)"),
        ("parallel.ddp_bucket_mb", config.parallel.ddp_bucket_mb, config.parallel.ddp_bucket_mb > 0,
         "a finite number > 0"),
        ("parallel.fsdp_shard_size", config.parallel.fsdp_shard_size,
         config.parallel.fsdp_shard_size is None or config.parallel.fsdp_shard_size >= 1, "an integer >= 1 (or unset)"),
        ("parallel.planner.margin", config.parallel.planner.margin, 0 <= config.parallel.planner.margin < 1,
         "in [0, 1)"),
    )
    if config.model.lora is not None:  # its other limits: loongforge.models.lora.check_lora_settings
        rules += (("model.lora.alpha", config.model.lora.alpha, config.model.lora.alpha > 0, "a finite number > 0"),)
    for key, value, in_range, what in rules:
        if not in_range or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{origin_of(config.source, key)}: {key} must be {what}, got {value!r}")


def _check_override_types(family: ModelFamily, config: LoongForgeConfig) -> None:
    """``model.overrides``: each key a field of the family's dataclass (did-you-mean), each value of its type."""
    overrides = config.model.overrides
    if not dataclasses.is_dataclass(family):
        return
    names = [f.name for f in dataclasses.fields(family)]
    unknown = [key for key in overrides if key not in names]
    if unknown:
        raise unknown_key_error(f"model.overrides.{unknown[0]}", str(unknown[0]), names, config.source)
    hints = typing.get_type_hints(type(family))
    for key, value in overrides.items():
        convert(hints[key], value, config.source, f"model.overrides.{key}")


def _names(config: LoongForgeConfig, family: ModelFamily, backend: DeviceBackend, host: PluginHost) -> list[str]:
    """``kind: name (from provider)`` for each component the run uses (a task model reads no data.* names)."""
    from loongforge.resolve import resolve_names

    registry = host.registry("device")
    if backend.name in registry:
        entry = registry.entry(backend.name, where=f"device in {config.source}")
        lines = [f"device: {entry.name} (from {entry.provider})"]
    else:  # selected by import path (a backend under development, not registered by any plugin)
        lines = [f"device: {backend.name} (from {type(backend).__module__}, by import path)"]
    return lines + [line for line in resolve_names(config, engine=family.engine) if not line.startswith("device:")]


def _check_optimizations(config: LoongForgeConfig, host: PluginHost) -> None:
    registry = host.registry("optimization")
    for name, options in config.optimizations.items():
        where = f"optimizations.{name} in {config.source}"
        cls = check_optimization(registry.load(name, where=where), name, where)
        optimization_options(cls, options, config.source, f"optimizations.{name}")


#: ``model:`` keys only megatron models take, and the ``task:`` option a family may offer instead.
MEGATRON_MODEL_KEYS = {"model.lora": "lora", "model.load": "init", "model.recompute": "recompute"}


def _check_task_model_keys(config: LoongForgeConfig, family: ModelFamily) -> None:
    """A task model takes ``model.freeze`` but not the ``model:`` keys that act on megatron decoder chunks: each would
    be ignored or end in a traceback once the model is built, so each is one line naming the family's own option."""
    given = {"model.lora": config.model.lora, "model.load": config.model.load,
             "model.recompute": config.model.recompute}
    options = type(family).task_options
    offered = {f.name for f in dataclasses.fields(options)} if options is not None else set()
    for key, value in given.items():
        if value is not None:
            instead = (f"; set task.{MEGATRON_MODEL_KEYS[key]} instead" if MEGATRON_MODEL_KEYS[key] in offered
                       else "")
            raise ConfigError(f"{origin_of(config.source, key)}: {key} applies to megatron models; model "
                              f"'{config.model.name or family.family_name}' is trained by the task engine{instead}")


def _check_task_layout(config: LoongForgeConfig, world_size: int, host: PluginHost) -> str:
    """A task model's settings and torch-native layout (``parallel.strategy`` left at ``megatron``, which splits
    decoder layers, means ``ddp`` for it)."""
    t, where = config.training, config.source
    if t.precision not in TASK_PRECISIONS:
        raise ConfigError(f"{where}: training.precision '{t.precision}' is not supported for model "
                          f"'{config.model.name}' ({', '.join(TASK_PRECISIONS)})")
    if t.loss_normalization != "micro_batch":
        raise ConfigError(f"{where}: training.loss_normalization '{t.loss_normalization}' applies to token-level "
                          f"(megatron) models; model '{config.model.name}' trains a task whose loss is a mean over "
                          "samples (leave it at micro_batch)")
    if t.offload_activations is not None:
        raise ConfigError(f"{where}: training.offload_activations applies to megatron decoder layers; model "
                          f"'{config.model.name}' trains a task (leave it unset)")
    name = "ddp" if config.parallel.strategy == "megatron" else config.parallel.strategy
    located = f"parallel.strategy in {where}"
    strategy = check_strategy(host.registry("strategy").load(name, where=located), name, "task", located,
                              config.model.name or "")
    layout = strategy.validate(config.parallel, world_size, where)
    return f"parallel: {layout.describe()}"


def _check_megatron(config: LoongForgeConfig, world_size: int, family: ModelFamily, backend: DeviceBackend,
                    host: PluginHost) -> tuple[list[str], int | None]:
    """Layout, batch, precision, LoRA and ``model.load`` of a megatron-engine model; what resolved, and the global
    batch (``None`` under ``parallel: auto``, whose planner picks it at train time)."""
    from loongforge.config.chunk_settings import check_seq_chunks

    decoder, lines, global_batch = family.decoder, [], None
    where = f"parallel.strategy in {config.source}"
    strategy = check_strategy(host.registry("strategy").load(config.parallel.strategy, where=where),
                              config.parallel.strategy, "megatron", where, config.model.name or family.family_name)
    if config.parallel.auto:
        from loongforge.train.batches import check_pack

        check_pack(config, decoder, 1)  # the planner keeps cp at 1 for packed rows
        check_seq_chunks(config, decoder, cp=1, vpp=None)
        lines.append(f"parallel: auto (the planner chooses the layout for {world_size} process(es) at train time)")
    else:
        layout = strategy.validate(config.parallel, world_size, config.source)
        # what the layout needs from the model is the family's own pre-flight (ModelFamily.check_layout)
        plan = strategy.check_model(layout, family, config.training, config.source,
                                    seq_length=config.data.seq_length)
        from loongforge.train.batches import check_pack

        check_pack(config, decoder, layout.cp)
        check_seq_chunks(config, decoder, cp=layout.cp, vpp=layout.vpp)
        global_batch = plan.global_batch_size
        from loongforge.train.memory_preflight import check_batch_fits

        check_batch_fits(config, family, backend, layout, plan.num_microbatches, world_size)
        chunked = (f", each sequence in {config.parallel.seq_chunks} chunks (chunked pipeline)"
                   if config.parallel.seq_chunks > 1 else "")
        lines.append(f"parallel: tp={layout.tp} pp={layout.pp} {layout.cp_description} ep={layout.ep} dp={layout.dp} "
                     f"for {world_size} process(es), {plan.num_microbatches} micro-batch(es) per step{chunked}")
        from loongforge.models.recompute import recompute_kwargs  # megatron's own checks come after process groups

        recompute_kwargs(config.model.recompute, decoder.num_layers // (layout.pp * layout.num_chunks), config.source)
        from loongforge.parallel.moe_overlap_check import check_moe_a2a_overlap

        if (overlap := check_moe_a2a_overlap(config, layout, decoder, backend)) is not None:
            lines.append(overlap)
    from loongforge.config.offload_settings import check_offload

    if (offload := check_offload(config, decoder.num_layers)) is not None:
        lines.append(offload)
    if config.evaluation.tasks:
        from loongforge.evaluation.harness import check_evaluation_tasks

        check_evaluation_tasks(config, family, None if config.parallel.auto else layout)
    settings = _device_settings(config, backend)
    lines.append(f"precision: {config.training.precision} on {backend.name} (parameters {settings.params_dtype})")
    if config.model.lora is not None:
        from loongforge.models.lora import check_lora_settings

        check_lora_settings(config.model.lora, config.source, backend,
                            decoder.lora_linears if decoder is not None else None)
        if config.model.lora.base_dtype is not None:
            lines.append(f"model.lora.base_dtype: the frozen base in {config.model.lora.base_dtype}, adapters in fp32")
    if config.model.load:
        from loongforge.interop.load_source import model_load_source

        lines.append(f"model.load: {_keyed(config, 'model.load', lambda: model_load_source(config, family))}")
    return lines, global_batch


def _device_settings(config: LoongForgeConfig, backend: DeviceBackend) -> MegatronSettings:
    """``training.precision`` and ``device_options`` through the device (which owns precision recipes and its
    switches): an unsupported request fails here with the device's reason."""
    options = device_options(backend, config)
    try:
        return backend.megatron_settings(config.training.precision, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{config.source}: training.precision / device_options: {exc}") from None


def _check_dataset(config: LoongForgeConfig, family: ModelFamily, host: PluginHost,
                   global_batch: int | None) -> list[str]:
    """The data of a megatron model, opened and split as training does (after the names, settings and paths it
    needs are known good), and -- when the run evaluates -- its validation rows against one ``global_batch``; what
    they hold, one line each."""
    from loongforge.train.batches import (
        open_dataset,
        split_dataset,
        validation_batch_count,
        validation_origin,
        validation_rows,
    )

    tokenizer = _check_data(config, family.decoder, host)
    # Raw text is tokenized (and cached for training) here: show progress where someone watches, on one rank.
    progress = sys.stderr.isatty() and int(os.environ.get("RANK", "0")) == 0
    train, valid = split_dataset(open_dataset(host, config, tokenizer, model=family, progress=progress), config)
    held_out = f", {len(valid)} held out" if valid is not None else ""
    lines = [f"data: {config.data.dataset}: {len(train)} training sample(s){held_out}"]
    ev = config.evaluation
    rows = None
    if ev.interval:
        rows = _keyed(config, "evaluation.data", lambda: validation_rows(host, config, tokenizer, valid, model=family,
                                                                        progress=progress))
        origin = validation_origin(config)
        if global_batch is None:
            lines.append(f"evaluation: every {ev.interval} steps on {origin}: {len(rows)} sample(s)")
        else:
            batches = validation_batch_count(config, len(rows), global_batch, origin)
            lines.append(f"evaluation: every {ev.interval} steps on {batches} global batch(es) of {global_batch} "
                         f"from {origin}")
    if is_rl_run(config):  # every reward the prompts name exists, and every regex answer compiles
        from loongforge.train.rl.rewards import resolve_rewards

        names = resolve_rewards(config, host, [*train.prompts, *(rows.prompts if rows is not None else [])])
        lines.append(f"rewards: {', '.join(sorted(names))}")
    return lines


def _check_data(config: LoongForgeConfig, decoder: Any, host: PluginHost) -> Any:
    """Phase, sequence length and tokenizer against the model; the tokenizer."""
    from loongforge.train.batches import PHASES, load_tokenizer

    where = config.source
    if config.training.phase not in PHASES:
        raise ConfigError(f"{where}: training.phase must be one of {', '.join(PHASES)}, got '{config.training.phase}'")
    if config.data.seq_length < 1:
        raise ConfigError(f"{where}: data.seq_length must be >= 1, got {config.data.seq_length}")
    if config.data.seq_length > decoder.max_position_embeddings:
        raise ConfigError(f"{where}: data.seq_length ({config.data.seq_length}) exceeds the model's "
                          f"max_position_embeddings ({decoder.max_position_embeddings})")
    tokenizer = _keyed(config, "data.tokenizer", lambda: load_tokenizer(host, config))
    if tokenizer.vocab_size > decoder.vocab_size:
        fix = ("use a tokenizer of that model (data.tokenizer)" if (config.model.load or "").startswith("hf:")
               else "set model.overrides.vocab_size")
        raise ConfigError(f"{where}: tokenizer '{config.data.tokenizer}' has {tokenizer.vocab_size} ids but model "
                          f"'{config.model.name}' only {decoder.vocab_size} ({fix})")
    return tokenizer


def _check_paths(config: LoongForgeConfig, paths: list[tuple[str, str]]) -> None:
    """Each named path exists (a data path may also be a prefix of files, as memory-mapped datasets are named)."""
    resume = config.checkpoint.resume
    if resume not in ("never", *AUTO_RESUMES):
        paths.append(("checkpoint.resume", resume))
    for key, value in paths:
        path = Path(value).expanduser()
        if not (path.exists() or any(path.parent.glob(f"{path.name}.*"))):
            raise ConfigError(f"{origin_of(config.source, key)}: '{key}' names {value}, which does not exist")
