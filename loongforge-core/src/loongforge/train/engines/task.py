"""The task step engine: a plain ``torch.nn.Module`` built by a task (:mod:`loongforge.tasks`), trained with AdamW
and gradient clipping on one process or under a torch-native strategy (DDP, ZeRO-1, FSDP2, HSDP; see
:mod:`loongforge.parallel.torch_native`).

The loop (:mod:`loongforge.train.loop`) drives it exactly as it drives the megatron engine: the same learning-rate
schedule, hooks, metrics and checkpoint cadence. This module owns what is particular to task models: a seeded data
order, the task's loss and validation loss (:meth:`TaskEngine.evaluate`), and checkpoints that continue bit-exactly
(model, optimizer, every RNG stream including the task's own, data position). A checkpoint holds
``model.safetensors``, ``optimizer.pt`` and ``state.pt`` (loaded with ``weights_only=True``), ``trainer.json``,
per-rank ``rng-<rank>.pt`` and the resolved ``config.yaml`` (which
:func:`loongforge.train.task_checkpoint.load_task_model` rebuilds the model from, e.g. for ``loongforge sample``).
"""

from __future__ import annotations

import io
import json
import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.distributed.tensor import DTensor

from loongforge.checkpoint.layout import CONFIG_YAML, warn
from loongforge.checkpoint.manifest import CheckpointCorruptError
from loongforge.checkpoint.rng import capture_rng_state, restore_rng_state
from loongforge.checkpoint.state_files import (
    TASK_STATE,
    check_fields,
    load_plain,
    restore_checked,
    rng_state,
    task_trainer_state,
)
from loongforge.checkpoint.writer import CheckpointWriter, RankShare, save_torch, write_blobs
from loongforge.config.loader import config_to_dict
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.parallel.strategy import check_strategy
from loongforge.parallel.torch_native import clip_grad_norm
from loongforge.tasks import VALIDATION_STEP, TaskBase, check_task_parallel, sample_generators
from loongforge.train.activation_memory import FirstStepActivations
from loongforge.train.batches import validation_batch_count
from loongforge.train.compile import CompileReport, compile_blocks
from loongforge.train.engines.base import StepEngine, StepResult
from loongforge.train.resume_settings import SETTINGS_KEY, check_resume_settings, schedule_settings

if TYPE_CHECKING:
    from loongforge.train.health import StepHealth
    from loongforge.train.trainer import Trainer


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


def collate_samples(samples: list[dict[str, torch.Tensor]], indices: list[int], device: torch.device
                    ) -> dict[str, Any]:
    """A task batch: the samples' tensors stacked, and ``index`` (their global dataset indices, from which tasks
    seed per-sample draws), on ``device`` (also how ``loongforge diff`` replays a task model's batch)."""
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


#: What rank 0 writes from the model, the optimizer and the task's state (beside ``trainer.json`` and the config).
_STATE_FILES = ("model.safetensors", "optimizer.pt", "state.pt")


def _write_state_files(tmp: Path, model_state: dict, optim_state: dict, state: dict) -> None:
    """:data:`_STATE_FILES` from the live state (a synchronous save). ``torch.save`` gets streams, as in
    :func:`_state_blobs`: it names the archive inside after a path, so a path would give different bytes."""
    save_file({k: t.detach().contiguous() for k, t in model_state.items()}, str(tmp / "model.safetensors"))
    for name, value in (("optimizer.pt", optim_state), ("state.pt", state)):
        with open(tmp / name, "wb") as handle:
            torch.save(value, handle)


def _state_blobs(model_state: dict, optim_state: dict, state: dict) -> dict[str, bytes | memoryview]:
    """The bytes of :data:`_STATE_FILES`, the same :func:`_write_state_files` writes: a background save's snapshot."""
    blobs: dict[str, bytes | memoryview] = {
        "model.safetensors": safetensors_bytes({k: t.detach().contiguous() for k, t in model_state.items()})}
    for name, value in (("optimizer.pt", optim_state), ("state.pt", state)):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        blobs[name] = buffer.getbuffer()
    return blobs


def _safetensors(path: Path, device: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors file; a missing or damaged one is one line naming it."""
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing (the model's weights)")
    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # safetensors' own error type for a bad header or truncated data  # noqa: BLE001
        raise CheckpointCorruptError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def _strategy(config: LoongForgeConfig, world_size: int, host: Any) -> tuple[Any, Any]:
    """The torch-native strategy and layout of a multi-process task run (``(None, None)`` for one process).

    ``parallel.strategy`` left at its default (``megatron``, which splits decoder layers) means ``ddp`` here.
    """
    name = "ddp" if config.parallel.strategy == "megatron" else config.parallel.strategy
    where = f"parallel.strategy in {config.source}"
    strategy = check_strategy(host.registry("strategy").load(name, where=where), name, "task", where,
                              config.model.name)
    layout = strategy.validate(config.parallel, world_size, config.source)
    return (strategy, layout) if world_size > 1 else (None, None)


class TaskEngine(StepEngine):
    """Model, optimizer and data order of a task, and its step.

    With several processes each data-parallel rank trains ``micro_batch_size`` samples of a global batch of
    ``micro_batch_size x dp`` under a torch-native strategy; the task's loss is its local mean, so the averaged
    gradient is the global batch's. With ``parallel.cp > 1`` the ``cp`` ranks of a context-parallel group train the
    same samples, each a share of every sequence, and ``dp = world / cp``. The settings were checked before
    (:mod:`loongforge.train.preflight`: precision, loss normalisation, optimizer).
    """

    name: ClassVar[str] = "task"

    def __init__(self, config: LoongForgeConfig, task: Any, backend: Any, host: Any, *, rank: int = 0,
                 world_size: int = 1) -> None:
        if not isinstance(task, TaskBase):
            raise ConfigError(f"{config.source}: model '{config.model.name}' made a {type(task).__name__}, which "
                              "is not a loongforge.tasks.TaskBase")
        if config.training.threads:
            torch.set_num_threads(config.training.threads)
        strategy, layout = _strategy(config, world_size, host)
        self.config, self.task, self.backend, self.host = config, task, backend, host
        self.rank, self.world_size, self.strategy, self.layout = rank, world_size, strategy, layout
        self.cp = layout.cp if layout is not None else 1
        self.dp_rank, self.dp_size = (layout.dp_rank(rank), layout.dp) if layout is not None else (0, 1)
        check_task_parallel(task, config)
        if self.cp > 1:
            task.use_context_parallel(strategy.context_parallel_group(layout))
        self.device = backend.device()
        torch.manual_seed(config.run.seed)  # the same initial weights on every rank
        random.seed(config.run.seed)  # and the same streams in every run: a checkpoint records them all
        np.random.seed(config.run.seed)
        model = host.modify_model(task.place_model(task.build_model(), backend, self.device), config)
        #: Parameter count of the whole model, taken before a strategy shards it.
        self.num_params = sum(p.numel() for p in model.parameters())
        self.param_names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.data = task.build_dataset()
        self.samples_per_step = config.training.micro_batch_size * self.dp_size
        self.order = BatchOrder(len(self.data), self.samples_per_step, config.run.seed)
        self.validation, self.validation_batches = self._validation() if config.evaluation.interval else (None, 0)
        unwrapped = model
        if strategy is not None:
            model = strategy.wrap(model, layout, config.parallel, bf16=config.training.precision == "bf16",
                                  run_forward=self._probe_forward, sparse_parameters=task.sparse_parameters,
                                  tensor_parallel=task.use_tensor_parallel)
        self.model = model
        #: What ``training.compile`` compiled (after the strategy's probe forward, which runs one sample and
        #: would otherwise compile a graph for a batch of one); its time is printed after the first step.
        self.compiled = self._compile(unwrapped)
        self._compile_reported = False
        # One micro-batch's saved activations by component, counted in the first step of an eager run whose
        # parameters are whole on every rank; sharded (DTensor) parameters are gathered into buffers the count
        # could not tell from activations.
        sharded = any(isinstance(p, DTensor) for p in unwrapped.parameters())
        self._activations = FirstStepActivations(None if self.compiled.enabled or sharded else [unwrapped])
        opt = config.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        adamw = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
                     fused=fused_adamw_applies(params))
        self.optimizer = strategy.optimizer(params, **adamw) if strategy else torch.optim.AdamW(params, **adamw)
        task.use_optimizer(self.optimizer)
        self._saves = CheckpointWriter(background=config.checkpoint.async_save)

    def _compile(self, model: nn.Module) -> CompileReport:
        """``training.compile``: ``regional`` compiles the task's repeated blocks (:meth:`TaskBase.repeated_blocks`)
        one by one, ``true`` the whole model as one module (its forward around the blocks too: embeddings, head,
        loss-side reshapes). Both in place, so parameter names, checkpoints and the strategy's wrapping stay."""
        mode = self.config.training.compile
        if mode != "regional":
            return compile_blocks([], mode, rest=[model])
        blocks = self.task.repeated_blocks(model)
        if not blocks:
            raise ConfigError(f"{self.config.source}: training.compile: regional: model '{self.config.model.name}' "
                              "has no repeated blocks to compile; use training.compile: true (the whole model)")
        return compile_blocks(blocks, mode)

    def _report_compile(self) -> None:
        """One line after the first step (when the forward and backward graphs have been compiled)."""
        self._compile_reported = True
        if self.compiled.enabled and self.rank == 0:
            modules = ", ".join(f"{count} {name}" for name, count in self.compiled.modules.items())
            print(f"[loongforge] training.compile {self.compiled.mode}: {modules} compiled in "
                  f"{self.compiled.compile_s():.1f} s ({self.compiled.graphs()} graph(s))", flush=True)

    def _validation(self) -> tuple[Any, int]:
        """The task's validation samples (its held-out split, or ``evaluation.data``) and the global batches of them
        an evaluation reads."""
        ev = self.config.evaluation
        dataset = self.task.validation_dataset(list(ev.data), ev.steps * self.samples_per_step)
        origin = f"evaluation.data ({', '.join(ev.data)})" if ev.data else "the task's held-out split"
        return dataset, validation_batch_count(self.config, len(dataset), self.samples_per_step, origin)

    def describe(self) -> str:
        """One line for the run log: size, data, layout and evaluation."""
        layout = f", {self.layout.describe()}" if self.strategy is not None else ""
        evaluation = (f"; evaluation every {self.config.evaluation.interval} steps on {self.validation_batches} "
                      f"global batch(es)" if self.validation is not None else "")
        return (f"model: {self.config.model.name} ({self.num_params / 1e6:.2f}M parameters), {len(self.data)} "
                f"samples, global batch {self.samples_per_step}{layout}{evaluation}")

    def _probe_forward(self, model: nn.Module) -> None:
        """One forward on one sample (the FSDP planner records which modules run), leaving the task's and torch's
        random state as they were, so the run is the same as without it."""
        task_state = self.task.state_dict()
        with torch.random.fork_rng(devices=[]):
            self.task.training_step(model, collate_samples([self.data[0]], [0], self.device))
        self.task.load_state_dict(task_state)

    def train_step(self, screen: StepHealth | None = None) -> StepResult:
        """One AdamW step on the next global batch; with a ``screen``, none (and no ``after_step``, e.g. no EMA
        update) when it finds the step bad."""
        mbs = self.config.training.micro_batch_size
        indices = self.order.next()[self.dp_rank * mbs : (self.dp_rank + 1) * mbs]
        batch = collate_samples([self.data[i] for i in indices], indices, self.device)
        self.model.train()
        with self._activations.step():
            loss = self.task.training_step(self.model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            # The strategies average gradients over all ranks that hold a parameter's slice (all of them, or the
            # dp x cp ranks of one tensor-parallel index), but a context-parallel rank holds only its share
            # (1/cp of the tokens) of its group's gradient: scaling by cp turns that average into the mean over
            # data-parallel groups, i.e. the gradient of the global batch.
            (loss * self.cp if self.cp > 1 else loss).backward()
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip > 0:
            grad_norm = clip_grad_norm(list(self.model.parameters()), clip)
        loss = loss.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(loss)
            loss /= self.world_size
        extra = self._step_metrics()
        if screen is not None:
            bad = screen.screen(float(loss), self._gradient_sum if grad_norm is None else lambda: grad_norm)
            if bad is not None:  # left out: weights, AdamW's moments and step count, the task's state stay
                return StepResult(loss=float(loss), grad_norm=grad_norm, skipped=True, extra=extra, bad=bad)
        self.optimizer.step()
        self.task.after_step(self.model)
        if not self._compile_reported:
            self._report_compile()
        return StepResult(loss=float(loss), grad_norm=grad_norm, extra=extra)

    def _step_metrics(self) -> dict[str, float]:
        """The task's :meth:`~loongforge.tasks.TaskBase.step_metrics`, averaged over the ranks as the loss is."""
        named = self.task.step_metrics()
        if not named:
            return {}
        names = sorted(named)
        values = torch.stack([torch.as_tensor(named[name], dtype=torch.float64, device=self.device).detach()
                              for name in names])
        if self.world_size > 1:
            dist.all_reduce(values)
            values /= self.world_size
        return dict(zip(names, values.tolist(), strict=True))

    def evaluate(self) -> dict[str, float]:
        """The task's validation loss averaged over the first ``validation_batches`` global batches of its
        validation samples, in order (rank ``r`` of the data-parallel ranks takes the ``r``-th micro-batch of each,
        as in training), in eval mode without gradients.

        Each sample's draws come from its own generator seeded by (``run.seed``,
        :data:`~loongforge.tasks.VALIDATION_STEP`, its index): the same noise and timesteps at every evaluation and
        on every layout, and none from the streams training draws from. Averaged over all ranks like the training
        loss (context-parallel ranks each hold their group's loss)."""
        mbs = self.config.training.micro_batch_size
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                for number in range(self.validation_batches):
                    first = number * self.samples_per_step + self.dp_rank * mbs
                    indices = list(range(first, first + mbs))
                    batch = collate_samples([self.validation[i] for i in indices], indices, self.device)
                    generators = sample_generators(self.config.run.seed, VALIDATION_STEP, batch["index"])
                    total += self.task.validation_loss(self.model, batch, generators).double()
        finally:
            self.model.train(was_training)
        if self.world_size > 1:
            dist.all_reduce(total)
        return {"loss": float(total) / (self.validation_batches * self.world_size)}

    def _gradient_sum(self) -> float:
        """The sum of every gradient over all ranks (FSDP2: of each rank's shard): finite exactly when every
        gradient is. For ``skip_step`` without clipping, where no gradient norm exists to tell."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sums = [(g.to_local() if isinstance(g, DTensor) else g).sum(dtype=torch.float32) for g in grads]
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)
        if self.world_size > 1:
            dist.all_reduce(total)
        return float(total)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def full_state(self) -> tuple[dict, dict] | None:
        """Model and optimizer state with full tensors and parameter names, on rank 0. Collective."""
        if self.strategy is None:
            return self.model.state_dict(), _named_optimizer_state(self.optimizer.state_dict(), self.param_names)
        full = self.strategy.full_state(self.model, self.optimizer)
        if full is None or self.strategy.kind in ("fsdp2", "hsdp"):
            return full
        return full[0], _named_optimizer_state(full[1], self.param_names)

    def save(self, trainer: Trainer) -> Path | None:
        """Rank 0 writes model, optimizer, task state, trainer state and config; every rank its own RNG streams, and
        hashes what it wrote. With ``checkpoint.async_save`` the model, optimizer and task state are serialised
        into memory here and written (and hashed) in the background; :meth:`complete_save` commits them."""
        step = trainer.step
        tmp = self._saves.begin(trainer.checkpoints, step)
        full = self.full_state()
        rng = f"rng-{self.rank}.pt"
        save_torch(capture_rng_state(self.backend), tmp / rng)
        if self.rank != 0:
            return self._saves.submit(RankShare(files=[rng]))
        model_state, optim_state = full
        state = {"task": self.task.state_dict(), "data_position": self.order.position}
        write = None
        if self._saves.background:  # bytes now: training goes on changing the live tensors
            write = partial(write_blobs, tmp, _state_blobs(model_state, optim_state, state))
        else:
            _write_state_files(tmp, model_state, optim_state, state)
        extra_state: dict[str, Any] = {}
        self.host.on_checkpoint_save(trainer, str(tmp), extra_state)
        meta = {"step": step, "model": self.config.model.name, "world_size": self.world_size,
                "extra_state": extra_state,
                SETTINGS_KEY: schedule_settings(self.config, self.samples_per_step),
                "scheduler_samples": trainer.scheduler.num_steps}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        config_text = yaml.safe_dump(config_to_dict(self.config), sort_keys=False)
        (tmp / CONFIG_YAML).write_text(config_text, encoding="utf-8")
        return self._saves.submit(RankShare(files=[rng, *_STATE_FILES], write=write))

    def complete_save(self, trainer: Trainer, *, wait: bool) -> Path | None:
        return self._saves.complete(wait=wait)

    def data_position(self) -> int:
        return self.order.position

    def seek_data(self, position: int) -> None:
        self.order.position = position

    def load(self, trainer: Trainer, path: Path) -> None:
        """Restore a checkpoint written at any world size (a rank without its RNG file starts fresh streams).

        The schedule moves on to the samples it had counted (fewer than step x batch when updates were skipped). The
        optimizer and schedule settings must match the checkpoint's (:mod:`loongforge.train.resume_settings`); the
        hyper-parameters in the optimizer's param groups are this config's either way (equal unless
        ``checkpoint.override_schedule`` accepted new ones), the moments the checkpoint's."""
        meta = task_trainer_state(path / "trainer.json")  # checked key by key: one line naming a bad one
        if meta.get("model") != self.config.model.name:
            raise ConfigError(f"checkpoint {path} is of model '{meta.get('model')}', the run is "
                              f"'{self.config.model.name}' (set checkpoint.resume: never to start fresh)")
        if check_resume_settings(meta.get(SETTINGS_KEY), self.config, self.samples_per_step, path):
            warn(f"{path}: optimizer/schedule settings differ from the checkpoint's; continuing with this config's "
                 "(checkpoint.override_schedule)")
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        state = check_fields(load_plain(path / "state.pt", "the task's state and data position"), TASK_STATE,
                             str(path / "state.pt"))
        rng = path / f"rng-{self.rank}.pt"
        streams = rng_state(load_plain(rng, "this rank's random streams"), rng) if rng.is_file() else None
        model_state = _safetensors(path / "model.safetensors", str(self.device))
        optim_state = load_plain(path / "optimizer.pt", "the optimizer's state")

        def load_weights() -> None:
            if self.strategy is not None and self.strategy.kind in ("fsdp2", "hsdp"):
                self.strategy.load_full_state(self.model, self.optimizer, model_state, optim_state)
            elif self.strategy is not None:
                self.strategy.load_full_state(self.model, self.optimizer, model_state,
                                              _indexed_optimizer_state(optim_state, self.param_names))
            else:
                self.model.load_state_dict(model_state)
                self.optimizer.load_state_dict(_indexed_optimizer_state(optim_state, self.param_names))

        restore_checked(load_weights, path / "optimizer.pt", "the model and optimizer state (model.safetensors, "
                                                             "optimizer.pt)")
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        restore_checked(lambda: self.task.load_state_dict(state["task"]), path / "state.pt", "the task's state")
        self.order.position = state["data_position"]
        trainer.step = meta["step"]
        trainer.scheduler.step(increment=int(meta.get("scheduler_samples", trainer.step * self.samples_per_step)))
        if streams is not None:
            restore_checked(lambda: restore_rng_state(streams, self.backend), rng, "the random streams")
        else:
            warn(f"{path} was written by {meta.get('world_size')} rank(s): rank {self.rank} starts fresh random "
                 "streams (the continuation is not bit-exact)")
        self.host.on_checkpoint_load(trainer, str(path), meta.get("extra_state", {}))

    # -- after training ------------------------------------------------------------------------------------------
    def finish(self, trainer: Trainer) -> dict[str, Any]:
        """The task's after-training work on rank 0 (on an unsharded copy of the model when several ranks trained),
        its entries printed there one per line, what ``training.compile`` cost (``compile``, ``compile_s``,
        ``compile_graphs``, ``compiled_modules``: :meth:`loongforge.train.compile.CompileReport.summary`) and one
        micro-batch's saved activations by component (``activation_mib``; empty when not counted).

        The task's work runs eagerly even when training was compiled: sampling feeds other batch shapes than
        training's, and compiling a graph for each would cost more than the few dozen forwards it speeds up."""
        with torch.compiler.set_stance("force_eager"):
            results = self._task_finish(trainer)
        if self.rank != 0:
            return results
        return {**results, **self.compiled.summary(), "activation_mib": dict(self._activations.mib or {})}

    def _task_finish(self, trainer: Trainer) -> dict[str, Any]:
        """:meth:`Task.finish <loongforge.tasks.Task.finish>`'s entries (printed on rank 0; empty on the others)."""
        if self.strategy is None:
            results = self.task.finish(self.model, trainer.output_dir, trainer.media) or {}
        else:
            full = self.full_state()
            if self.rank != 0:
                return {}
            model = self.task.build_model().to(self.device)
            model.load_state_dict(full[0])
            results = self.task.finish(model, trainer.output_dir, trainer.media) or {}
        if self.rank == 0:
            for key, value in results.items():
                shown = ", ".join(f"{k} {v:.3f}" for k, v in value.items()) if isinstance(value, dict) else value
                print(f"[loongforge] {key.replace('_', ' ')}: {shown}", flush=True)
        return results
