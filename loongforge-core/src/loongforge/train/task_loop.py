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
import yaml
from safetensors.torch import load_file, save_file

from loongforge.checkpoint.layout import CheckpointDir
from loongforge.checkpoint.manifest import write_manifest
from loongforge.checkpoint.rng import capture_rng_state, restore_rng_state
from loongforge.checkpoint.saver import CONFIG_YAML
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


def _collate(samples: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]).to(device) for key in samples[0]}


class TaskTrainer:
    """Model, optimizer, data order and the step; ``host`` hooks see this object as ``trainer``."""

    def __init__(self, config: LoongForgeConfig, task: Any, backend: Any, host: Any) -> None:
        self.config, self.task, self.backend, self.host = config, task, backend, host
        self.device = backend.device()
        torch.manual_seed(config.run.seed)
        self.model = task.build_model().to(self.device)
        self.model = host.modify_model(self.model, config)
        self.dataset = task.build_dataset()
        self.order = BatchOrder(len(self.dataset), config.training.micro_batch_size, config.run.seed)
        opt = config.optimizer
        if opt.name.lower() not in ("adamw", "adam"):
            raise ConfigError(f"{config.source}: optimizer.name '{opt.name}' is not supported (use adamw)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.step = 0

    def train_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.step += 1
        lr = lr_at(self.step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = _collate([self.dataset[i] for i in self.order.next()], self.device)
        self.model.train()
        loss = self.task.training_step(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.config.optimizer.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)) if clip > 0 else None
        self.optimizer.step()
        step_time = time.perf_counter() - start
        samples = self.config.training.micro_batch_size
        return {"loss": float(loss.detach()), "lr": lr, "grad_norm": grad_norm, "step_time": step_time,
                "samples_per_s": samples / step_time}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save(self, directory: CheckpointDir) -> Path:
        tmp = directory.begin(self.step)
        state = {name: t.detach().contiguous() for name, t in self.model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"rng": capture_rng_state(self.backend), "task": self.task.state_dict(),
                    "data_position": self.order.position}, tmp / "state.pt")
        extra_state: dict[str, Any] = {}
        self.host.on_checkpoint_save(self, str(tmp), extra_state)
        meta = {"step": self.step, "model": self.config.model.name, "extra_state": extra_state}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        (tmp / CONFIG_YAML).write_text(yaml.safe_dump(config_to_dict(self.config), sort_keys=False), encoding="utf-8")
        write_manifest(tmp, step=self.step)
        return directory.commit(tmp, self.step)

    def load(self, path: Path) -> None:
        meta = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
        if meta.get("model") != self.config.model.name:
            raise ConfigError(f"checkpoint {path} is of model '{meta.get('model')}', the run is "
                              f"'{self.config.model.name}' (set checkpoint.resume: never to start fresh)")
        self.model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(self.device)))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        state = torch.load(path / "state.pt", weights_only=True)
        restore_rng_state(state["rng"], self.backend)
        self.task.load_state_dict(state["task"])
        self.order.position = state["data_position"]
        self.step = meta["step"]
        self.host.on_checkpoint_load(self, str(path), meta.get("extra_state", {}))


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


def run_task(config: LoongForgeConfig, task: Any, backend: Any, host: Any, *, world_size: int, say: Any) -> dict:
    """Train ``task`` as ``config`` says (one process); return the summary."""
    from loongforge.train.metrics import MetricsWriter
    from loongforge.train.progress import ProgressDisplay

    if world_size != 1:
        raise ConfigError(f"{config.source}: model '{config.model.name}' trains in one process for now "
                          f"(got a world of {world_size}); launch it without torchrun")
    if config.training.steps < 1:
        raise ConfigError(f"{config.source}: training.steps must be >= 1, got {config.training.steps}")
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    trainer = TaskTrainer(config, task, backend, host)
    output_dir = Path(config.run.output_dir)
    directory = CheckpointDir(config.checkpoint.dir or output_dir / "checkpoints", config.checkpoint.keep_last)
    resume = _resume_from(config, directory, say)
    if resume is not None:
        trainer.load(resume)
        say(f"resumed from {resume} (step {trainer.step})")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    say(f"model: {config.model.name} ({n_params / 1e6:.2f}M parameters), {len(trainer.dataset)} samples, "
        f"batch {config.training.micro_batch_size}")
    log = config.logging
    metrics = MetricsWriter(output_dir, rank=0, jsonl=log.jsonl, tensorboard=log.tensorboard, start_step=trainer.step)
    progress = ProgressDisplay(config.training.steps, start_step=trainer.step, rank=0, enabled=log.progress)
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
        "samples_per_s": len(timed) * config.training.micro_batch_size / sum(r["step_time"] for r in timed)
        if timed else 0.0,
        "checkpoint_dir": str(last_saved) if last_saved else None,
    }
    if summary["final_loss"] is not None:
        say(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
            f"{summary['samples_per_s']:,.1f} samples/s")
    if last_saved is not None:
        say(f"checkpoint: {last_saved}")
    finished = task.finish(trainer.model, output_dir) or {}
    for key, value in finished.items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in value.items()) if isinstance(value, dict) else value
        say(f"{key.replace('_', ' ')}: {shown}")
    summary.update(finished)
    host.on_train_end(trainer, summary)
    return summary


def load_task_model(checkpoint: str | Path) -> tuple[Any, Any, Path]:
    """``(task, model, checkpoint dir)`` from a task checkpoint (or a checkpoint root's ``latest``), verified."""
    from loongforge.config.loader import load_config
    from loongforge.interop.mcore_checkpoint import find_checkpoint
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
    return task, model.eval(), path
