"""One batch through a task model (diffusion DiT, policy, any :class:`loongforge.tasks.Task`) from its checkpoint,
for ``loongforge diff``.

A task model has no common forward signature, so the replay goes through the task's own deterministic loss,
:meth:`~loongforge.tasks.Task.validation_loss`: the first ``samples`` items of the task's training data, stacked as
the task engine stacks them, with every random draw (noise, timesteps) from one seeded CPU generator per sample --
so two checkpoints of one task see the same inputs and the same draws, and every difference is the models'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loongforge.diffing.trace import Trace, trace_loss
from loongforge.errors import InteropError


def is_task_checkpoint(path: Path) -> bool:
    """A checkpoint (or checkpoint root) the task engine wrote: its weights are ``model.safetensors`` (looked at
    only; the trace verifies it)."""
    from loongforge.checkpoint.layout import CheckpointNotFoundError, locate_checkpoint

    try:
        return (locate_checkpoint(path) / "model.safetensors").is_file()
    except CheckpointNotFoundError:  # not a checkpoint: the caller tries the other kinds
        return False


@dataclass(frozen=True)
class TaskReplay:
    """What one batch through a task model needs: the task, its model, the collated batch, the model's family and
    description, and the seeds of the per-sample generators (:meth:`generators` gives fresh ones, so two models --
    LoongForge's and a reference's -- draw the same noise)."""

    task: Any
    model: Any
    batch: Any
    family: Any
    label: str
    seeds: tuple[int, ...]

    def generators(self) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(seed) for seed in self.seeds]

    def loss(self, model: Any, generators: list[torch.Generator]) -> Any:
        """``validation_loss`` of ``model`` on the batch; a task without one is a one-line error."""
        try:
            return self.task.validation_loss(model, self.batch, generators)
        except NotImplementedError:
            raise InteropError(f"{self.label}: task {type(self.task).__name__} has no deterministic loss "
                               "(validation_loss), so `loongforge diff` cannot replay a batch through it") from None


def task_replay(path: Path, *, samples: int, seed: int, trust_code: bool,
                device: torch.device | None = None) -> TaskReplay:
    """The task model at ``path`` on ``device`` (default the CPU; the device backend's patches applied by the
    caller, as a run applies them) with its first ``samples`` training samples."""
    from loongforge.claims import checkpoint_model
    from loongforge.tasks import sample_seed
    from loongforge.train.engines.task import collate_samples
    from loongforge.train.task_checkpoint import load_task_model

    task, model, found = load_task_model(path, trust_code=trust_code)
    family = checkpoint_model(str(found), trust_code=trust_code)
    data = task.build_dataset()
    count = min(samples, len(data))
    if count < 1:
        raise InteropError(f"{found}: the task's data is empty, there is no batch to replay")
    place = device or torch.device("cpu")
    model = model.to(place)
    batch = collate_samples([data[i] for i in range(count)], list(range(count)), place)
    model.eval()  # validation_loss's contract: no training-only regularisation, so both sides compute alike
    return TaskReplay(task, model, batch, family, f"{family.family_name} ({found})",
                      tuple(sample_seed(seed, 0, i) for i in range(count)))


def trace_task_checkpoint(path: Path, *, samples: int, seed: int, trust_code: bool,
                          device: torch.device | None = None) -> tuple[Trace, str, Any]:
    """The trace of one batch through the task model at ``path`` (:func:`task_replay`), the model's description
    and its model family (the checkpoint config's, overrides applied)."""
    replay = task_replay(path, samples=samples, seed=seed, trust_code=trust_code, device=device)
    return trace_loss(replay.model, lambda: replay.loss(replay.model, replay.generators())), replay.label, \
        replay.family


def task_settings(a: Any, b: Any) -> list[str]:
    """What differs between two task models' families (their dataclass fields), ``field: A vs B`` each."""
    if type(a) is not type(b):
        return [f"model family: {type(a).__name__} vs {type(b).__name__}"]
    if not dataclasses.is_dataclass(a):
        return []
    return [f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}" for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)]

