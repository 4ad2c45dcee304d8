"""The training loop for task models (see :mod:`loongforge.tasks`): plain torch, one process.

Same contract as the megatron path: AdamW with the config's warmup + decay schedule and gradient clipping,
a seeded data order, progress and metrics (JSONL + TensorBoard), the lifecycle hooks, atomic checkpoints with a
verified manifest, and resume that continues bit-exactly (model, optimizer, schedule, every RNG stream including
the task's own, data position). A checkpoint holds ``model.safetensors``, ``optimizer.pt`` and ``state.pt``
(loaded with ``weights_only=True``), ``trainer.json`` and the resolved ``config.yaml`` (which
:func:`load_task_model` rebuilds the model from, e.g. for ``loongforge sample``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from loongforge.checkpoint.layout import CONFIG_YAML, CheckpointDir, find_checkpoint, step_dir_name
from loongforge.checkpoint.manifest import write_manifest
from loongforge.checkpoint.rng import capture_rng_state, restore_rng_state
from loongforge.config.loader import config_to_dict
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError


def lr_at(step: int, config: LoongForgeConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then cosine/linear decay or constant."""
    opt, sched = config.optimizer, config.scheduler
    if sched.warmup_steps and step <= sched.warmup_steps:
        return opt.lr * step / sched.warmup_steps
    if sched.decay == "constant":
        return opt.lr
    span = max((sched.decay_steps or config.training.steps) - sched.warmup_steps, 1)
    progress = min((step - sched.warmup_steps) / span, 1.0)
    if sched.decay == "linear":
        return opt.min_lr + (opt.lr - opt.min_lr) * (1.0 - progress)
    if sched.decay == "cosine":
        return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"{config.source}: scheduler.decay '{sched.decay}' is not supported (cosine, linear, constant)")


class BatchOrder:
    """Batches of ``batch_size`` dataset indices in a fresh seeded permutation per epoch; ``position`` (batches
    drawn so far) is all a checkpoint needs to continue the same order."""

    def __init__(self, length: int, batch_size: int, seed: int) -> None:
        if length < batch_size:
            raise ConfigError(f"the dataset has {length} samples, fewer than training.micro_batch_size {batch_size}")
        self.length, self.batch_size, self.seed = length, batch_size, seed
        self.per_epoch = length // batch_size
        self.position = 0

    def next(self) -> list[int]:
        epoch, index = divmod(self.position, self.per_epoch)
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))
        self.position += 1
        return order[index * self.batch_size : (index + 1) * self.batch_size].tolist()


def _collate(samples: list[dict[str, torch.Tensor]], indices: list[int], device: torch.device) -> dict[str, Any]:
    batch = {key: torch.stack([s[key] for s in samples]).to(device) for key in samples[0]}
    batch["index"] = torch.tensor(indices, device=device)  # global dataset indices: per-sample seeds for tasks
    return batch


def _named_optimizer_state(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch's index-keyed optimizer state -> keyed by parameter name (the format checkpoints store)."""
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def _indexed_optimizer_state(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


class TaskTrainer:
    """Model, optimizer, data order and the step; ``host`` hooks see this object as ``trainer``.

    With several processes each data-parallel rank trains ``micro_batch_size`` samples of a global batch of
    ``micro_batch_size x dp`` under a torch-native strategy (:mod:`loongforge.parallel.torch_native`); the
    task's loss is its local mean, so the averaged gradient is the global batch's. With ``parallel.cp > 1`` the
    ``cp`` ranks of a context-parallel group train the same samples, each a share of every sequence, and
    ``dp = world / cp``.
    """

    def __init__(self, config: LoongForgeConfig, task: Any, backend: Any, host: Any, *, rank: int = 0,
                 world_size: int = 1, strategy: Any = None, layout: Any = None) -> None:
        self.config, self.task, self.backend, self.host = config, task, backend, host
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.cp = layout.cp if layout is not None else 1
        self.dp_rank, self.dp_size = rank // self.cp, world_size // self.cp
        if self.cp > 1:
            use_context_parallel = getattr(task, "use_context_parallel", None)
            if use_context_parallel is None:
                raise ConfigError(f"{config.source}: parallel.cp={self.cp}: model '{config.model.name}' does not "
                                  "support context parallelism")
            use_context_parallel(strategy.context_parallel_group(layout))
        self.device = backend.device()
        torch.manual_seed(config.run.seed)  # the same initial weights on every rank
        model = host.modify_model(task.build_model().to(self.device), config)
        #: Parameter count of the whole model, taken before a strategy shards it.
        self.num_params = sum(p.numel() for p in model.parameters())
        self.param_names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.dataset = task.build_dataset()
        self.order = BatchOrder(len(self.dataset), config.training.micro_batch_size * self.dp_size, config.run.seed)
        if strategy is not None:
            model = strategy.wrap(model, layout, config.parallel, bf16=config.training.precision == "bf16",
                                  run_forward=self._probe_forward)
        self.model = model
        opt = config.optimizer
        if opt.name.lower() not in ("adamw", "adam"):
            raise ConfigError(f"{config.source}: optimizer.name '{opt.name}' is not supported (use adamw)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        adamw = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
                     fused=fused_adamw_applies(params))
        self.optimizer = strategy.optimizer(params, **adamw) if strategy else torch.optim.AdamW(params, **adamw)
        self.step = 0

    def _probe_forward(self, model: nn.Module) -> None:
        """One forward on one sample (the FSDP planner records which modules run), leaving the task's and torch's
        random state as they were, so the run is the same as without it."""
        task_state = self.task.state_dict()
        with torch.random.fork_rng(devices=[]):
            self.task.training_step(model, _collate([self.dataset[0]], [0], self.device))
        self.task.load_state_dict(task_state)

    def train_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.step += 1
        lr = lr_at(self.step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mbs = self.config.training.micro_batch_size
        indices = self.order.next()[self.dp_rank * mbs : (self.dp_rank + 1) * mbs]
        batch = _collate([self.dataset[i] for i in indices], indices, self.device)
        self.model.train()
        loss = self.task.training_step(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        # The strategies average gradients over all ranks, but a context-parallel rank holds only its share
        # (1/cp of the tokens) of its group's gradient: scaling by cp turns that average into the mean over
        # data-parallel groups, i.e. the gradient of the global batch.
        (loss * self.cp if self.cp > 1 else loss).backward()
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        self.optimizer.step()
        after_step = getattr(self.task, "after_step", None)  # optional: EMA updates and the like
        if after_step is not None:
            after_step(self.model)
        loss = loss.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(loss)
            loss /= self.world_size
        step_time = time.perf_counter() - start
        return {"loss": float(loss), "lr": lr, "grad_norm": grad_norm, "step_time": step_time,
                "samples_per_s": mbs * self.dp_size / step_time}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _full_state(self) -> tuple[dict, dict] | None:
        """Model and optimizer state with full tensors and parameter names, on rank 0. Collective."""
        if self.strategy is None:
            return self.model.state_dict(), _named_optimizer_state(self.optimizer.state_dict(), self.param_names)
        full = self.strategy.full_state(self.model, self.optimizer)
        if full is None or self.strategy.kind in ("fsdp2", "hsdp"):
            return full
        return full[0], _named_optimizer_state(full[1], self.param_names)

    def save(self, directory: CheckpointDir) -> Path:
        """Rank 0 writes model, optimizer, trainer state and config; every rank its own RNG streams."""
        full = self._full_state()
        tmp = directory.tmp_path(self.step)
        if self.rank == 0:
            directory.begin(self.step)
        self._barrier()
        torch.save(capture_rng_state(self.backend), tmp / f"rng-{self.rank}.pt")
        self._barrier()
        final = directory.root / step_dir_name(self.step)
        if self.rank == 0:
            model_state, optim_state = full
            save_file({k: t.detach().contiguous() for k, t in model_state.items()}, str(tmp / "model.safetensors"))
            torch.save(optim_state, tmp / "optimizer.pt")
            torch.save({"task": self.task.state_dict(), "data_position": self.order.position}, tmp / "state.pt")
            extra_state: dict[str, Any] = {}
            self.host.on_checkpoint_save(self, str(tmp), extra_state)
            meta = {"step": self.step, "model": self.config.model.name, "world_size": self.world_size,
                    "extra_state": extra_state}
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
            config_text = yaml.safe_dump(config_to_dict(self.config), sort_keys=False)
            (tmp / CONFIG_YAML).write_text(config_text, encoding="utf-8")
            write_manifest(tmp, step=self.step)
            final = directory.commit(tmp, self.step)
        self._barrier()
        return final

    def load(self, path: Path) -> list[str]:
        """Restore a checkpoint written at any world size; return warnings (RNG streams of missing ranks)."""
        meta = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
        if meta.get("model") != self.config.model.name:
            raise ConfigError(f"checkpoint {path} is of model '{meta.get('model')}', the run is "
                              f"'{self.config.model.name}' (set checkpoint.resume: never to start fresh)")
        model_state = load_file(str(path / "model.safetensors"), device=str(self.device))
        optim_state = torch.load(path / "optimizer.pt", weights_only=True)
        if self.strategy is not None and self.strategy.kind in ("fsdp2", "hsdp"):
            self.strategy.load_full_state(self.model, self.optimizer, model_state, optim_state)
        elif self.strategy is not None:
            self.strategy.load_full_state(self.model, self.optimizer, model_state,
                                          _indexed_optimizer_state(optim_state, self.param_names))
        else:
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(_indexed_optimizer_state(optim_state, self.param_names))
        state = torch.load(path / "state.pt", weights_only=True)
        self.task.load_state_dict(state["task"])
        self.order.position = state["data_position"]
        self.step = meta["step"]
        warnings = []
        rng = path / f"rng-{self.rank}.pt"
        if rng.is_file():
            restore_rng_state(torch.load(rng, weights_only=True), self.backend)
        else:
            warnings.append(f"{path} was written by {meta.get('world_size')} rank(s): rank {self.rank} starts "
                            "fresh random streams (the continuation is not bit-exact)")
        self.host.on_checkpoint_load(self, str(path), meta.get("extra_state", {}))
        return warnings

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _resume_from(config: LoongForgeConfig, directory: CheckpointDir, say: Any) -> Path | None:
    resume = config.checkpoint.resume
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume)
    path, warnings = directory.find_valid()
    for warning in warnings:
        say(f"warning: {warning}")
    return path


def _strategy(config: LoongForgeConfig, world_size: int, host: Any) -> tuple[Any, Any]:
    """The torch-native strategy and layout of a multi-process task run (``(None, None)`` for one process).

    ``parallel.strategy`` left at its default (``megatron``, which splits decoder layers) means ``ddp`` here.
    """
    name = "ddp" if config.parallel.strategy == "megatron" else config.parallel.strategy
    strategy = host.registry("strategy").load(name, where=f"parallel.strategy in {config.source}")
    if not hasattr(strategy, "kind"):
        raise ConfigError(f"{config.source}: parallel.strategy '{name}' cannot train model '{config.model.name}'; "
                          "task models use ddp, zero1, fsdp2 or hsdp")
    layout = strategy.validate(config.parallel, world_size, config.source)
    return (strategy, layout) if world_size > 1 else (None, None)


def run_task(config: LoongForgeConfig, task: Any, backend: Any, host: Any, *, rank: int, world_size: int,
             say: Any) -> dict:
    """Train ``task`` as ``config`` says, on every rank of the process group; return the summary."""
    from loongforge.train.metrics import MetricsWriter
    from loongforge.train.progress import ProgressDisplay

    if config.training.steps < 1:
        raise ConfigError(f"{config.source}: training.steps must be >= 1, got {config.training.steps}")
    if config.training.precision not in ("fp32", "bf16"):
        raise ConfigError(f"{config.source}: training.precision '{config.training.precision}' is not supported for "
                          f"model '{config.model.name}' (fp32, bf16)")
    if config.training.loss_normalization != "micro_batch":
        raise ConfigError(f"{config.source}: training.loss_normalization '{config.training.loss_normalization}' "
                          f"applies to token-level (megatron) models; model '{config.model.name}' trains a task whose "
                          "loss is a mean over samples (leave it at micro_batch)")
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    strategy, layout = _strategy(config, world_size, host)
    trainer = TaskTrainer(config, task, backend, host, rank=rank, world_size=world_size, strategy=strategy,
                          layout=layout)
    output_dir = Path(config.run.output_dir)
    directory = CheckpointDir(config.checkpoint.dir or output_dir / "checkpoints", config.checkpoint.keep_last)
    resume = _resume_from(config, directory, say)
    if resume is not None:
        for warning in trainer.load(resume):
            print(f"[loongforge] warning: {warning}", flush=True)
        say(f"resumed from {resume} (step {trainer.step})")
    say(f"model: {config.model.name} ({trainer.num_params / 1e6:.2f}M parameters), {len(trainer.dataset)} samples, "
        f"global batch {config.training.micro_batch_size * trainer.dp_size}"
        + (f", {layout.describe()}" if layout else ""))
    log = config.logging
    metrics = MetricsWriter(output_dir, rank=rank, jsonl=log.jsonl, tensorboard=log.tensorboard,
                            start_step=trainer.step)
    progress = ProgressDisplay(config.training.steps, start_step=trainer.step, rank=rank, enabled=log.progress)
    host.on_train_start(trainer)
    history: list[dict[str, Any]] = []
    last_saved, saved_step = None, None
    try:
        while trainer.step < config.training.steps:
            row = trainer.train_step()
            history.append(row)
            logged = trainer.step % log.interval == 0 or trainer.step == config.training.steps
            metrics.record(trainer.step, row)
            progress.update(trainer.step, row, logged=logged)
            host.on_step_end(trainer, trainer.step, row)
            interval = config.checkpoint.interval
            if interval and trainer.step % interval == 0:
                last_saved, saved_step = trainer.save(directory), trainer.step
        if config.checkpoint.save_at_end and history and saved_step != trainer.step:
            last_saved = trainer.save(directory)
    finally:
        progress.close()
        metrics.close()
    timed = history[1:] or history
    summary = {
        "steps": trainer.step, "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "samples_per_s": len(timed) * config.training.micro_batch_size * trainer.dp_size
        / sum(r["step_time"] for r in timed) if timed else 0.0,
        "checkpoint_dir": str(last_saved) if last_saved else None,
    }
    if summary["final_loss"] is not None:
        say(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
            f"{summary['samples_per_s']:,.1f} samples/s")
    if last_saved is not None:
        say(f"checkpoint: {last_saved}")
    finished = _finish(trainer, task, output_dir)
    for key, value in finished.items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in value.items()) if isinstance(value, dict) else value
        say(f"{key.replace('_', ' ')}: {shown}")
    summary.update(finished)
    host.on_train_end(trainer, summary)
    return summary


def _finish(trainer: TaskTrainer, task: Any, output_dir: Path) -> dict[str, Any]:
    """The task's after-training work on rank 0, on an unsharded copy of the model when several ranks trained."""
    if trainer.strategy is None:
        return task.finish(trainer.model, output_dir) or {}
    full = trainer._full_state()
    if trainer.rank != 0:
        return {}
    model = task.build_model().to(trainer.device)
    model.load_state_dict(full[0])
    return task.finish(model, output_dir) or {}


def fused_adamw_applies(params: list[nn.Parameter]) -> bool:
    """Whether PyTorch's fused AdamW kernel can update ``params``: plain (not sharded DTensor) floating-point
    tensors on the CPU or a CUDA device.

    Why: the default (foreach) update walks the parameters in several passes; the fused one makes one. For an
    embedding-heavy policy (Pi0.5's 257k-id vocabulary) on the CPU the optimizer was ~70% of a training step, and
    the fused kernel does it ~4x faster with the same arithmetic up to float rounding (~1e-7 relative). FSDP2's
    DTensor shards keep the default.
    """
    return bool(params) and all(
        type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def load_task_model(checkpoint: str | Path) -> tuple[Any, Any, Path]:
    """``(task, model, checkpoint dir)`` from a task checkpoint (or a checkpoint root's ``latest``), verified.

    The task's own state (``state.pt``, e.g. a policy's normaliser and dimensions) is restored too, so the task
    can use the model at once without rebuilding its dataset."""
    from loongforge.config.loader import load_config
    from loongforge.plugins import get_host
    from loongforge.tasks import task_for

    path = find_checkpoint(checkpoint)
    config = load_config(path / CONFIG_YAML)
    model_object = get_host().registry("model").load(config.model.name, where=f"model.name in {path / CONFIG_YAML}")
    task = task_for(model_object, config)
    if task is None:
        raise ConfigError(f"{path}: model '{config.model.name}' is not a task model (use `loongforge generate`)")
    torch.manual_seed(config.run.seed)
    model = task.build_model()
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    if (path / "state.pt").is_file():
        task.load_state_dict(torch.load(path / "state.pt", weights_only=True)["task"])
    return task, model.eval(), path
