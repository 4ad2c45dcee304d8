"""Tasks: how model kinds other than megatron decoders (diffusion DiTs, later VLA policies) plug into ``train``.

A registered model family whose ``engine`` is ``"task"`` (:class:`loongforge.models.family.ModelFamily`)
supplies one from ``make_task(config)`` (deriving from :class:`TaskBase`) and is trained by the task engine
(:mod:`loongforge.train.engines.task`) under core's one loop (:mod:`loongforge.train.loop`) instead of megatron's
schedules. The task owns everything that is
specific to its model kind -- building the model and the dataset, the loss of one batch, the random streams
it draws from, its validation data and loss (``evaluation:``), and what to do after training (write samples, score
them) -- while core owns the loop,
optimizer, schedule, checkpoints, resume, metrics and progress, exactly as for LLMs. The task's options live
under ``task:`` in the run config, typed by the family's ``task_options`` dataclass: core checks them before the
run (:mod:`loongforge.config.plugin_sections`) and the task reads them with
:func:`~loongforge.config.plugin_sections.task_options`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from loongforge.errors import ConfigError

if TYPE_CHECKING:
    from loongforge.train.media import MediaLog


@runtime_checkable
class Task(Protocol):
    """What the task engine (:mod:`loongforge.train.engines.task`) needs from a model kind. Implement it by deriving
    from :class:`TaskBase`, which declares the optional slots with their defaults."""

    def build_model(self) -> Any:
        """A freshly initialised ``torch.nn.Module`` (seeded by the caller)."""

    def build_dataset(self) -> Any:
        """A map-style dataset whose items are dicts of tensors of equal shapes (stacked into batches)."""

    def training_step(self, model: Any, batch: dict[str, Any]) -> Any:
        """The scalar loss of one batch; the loop runs backward and the optimizer."""

    def state_dict(self) -> dict[str, Any]:
        """The task's own random streams (tensors/ints only), saved in checkpoints for bit-exact resume."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def finish(self, model: Any, output_dir: Path, media: MediaLog) -> dict[str, Any]:
        """After the last step: write samples or evaluate; the returned entries join the run summary. Pictures
        worth showing (samples, rollouts) go to ``media`` too (the run's trackers, :mod:`loongforge.train.media`)."""

    def sample_files(self, model: Any, prompts: list[str], out_dir: Path, *, steps: int, guidance: float, seed: int,
                     fmt: str) -> list[Path]:
        """``loongforge sample``: one file per prompt (``fmt`` gif, mp4 or png) written under ``out_dir``."""

    def validation_dataset(self, paths: list[str], samples: int) -> Any:
        """``evaluation.interval > 0``: the validation samples (see :meth:`TaskBase.validation_dataset`)."""

    def validation_loss(self, model: Any, batch: dict[str, Any], generators: list[Any]) -> Any:
        """The scalar loss of one validation batch (see :meth:`TaskBase.validation_loss`)."""


class TaskBase:
    """Base class of every task: the optional slots of :class:`Task`, declared once with their defaults.

    Why a base class: core calls these slots on every task without probing for them, and a task author reads here
    everything core may call beside the required methods.
    """

    #: Whether :meth:`use_context_parallel` is implemented; ``parallel.cp > 1`` is refused for a task without it.
    context_parallel: ClassVar[bool] = False
    #: Whether :meth:`use_tensor_parallel` is implemented; ``parallel.tp > 1`` is refused for a task without it.
    tensor_parallel: ClassVar[bool] = False
    #: Whether some steps leave parameters out of the loss (a mixture whose steps each train one part: Wan 2.2's
    #: two experts). DDP then looks for the unused ones each step (``find_unused_parameters``), so their gradients
    #: stay ``None`` and AdamW leaves them, their moments and their step counts alone; every rank must leave out the
    #: same ones. ``parallel.ddp_static_graph`` (one fixed set of used parameters) is refused for such a task.
    sparse_parameters: bool = False

    def after_step(self, model: Any) -> None:
        """Called after each optimizer step (EMA updates and the like); the default does nothing."""

    def step_metrics(self) -> dict[str, Any]:
        """Numbers of the last :meth:`~Task.training_step` beside its loss -- the terms of a loss of several, by
        name, as scalar tensors or floats -- averaged over the ranks like the loss and recorded with the step
        (metrics.jsonl, ``train/<name>``). Every rank returns the same names. The default: none."""
        return {}

    def place_model(self, model: Any, backend: Any, device: Any) -> Any:
        """Put what :meth:`~Task.build_model` made on ``device`` (``backend``'s, a
        :class:`~loongforge.devices.base.DeviceBackend`) and return it; called once, before any parallel wrapping.

        The default: ``model.to(device)``. A task whose model does not fit the device whole but uses one part at a
        time (Wan 2.2's two experts) puts only the part in use there and keeps the rest in host memory (through the
        backend's ``host_empty_strided``), moving the parts in and out as it uses them; such a task refuses
        ``parallel.strategy`` wrappers, which hold views of the parameters a move would leave behind."""
        return model.to(device)

    def use_optimizer(self, optimizer: Any) -> None:
        """Called once the engine has built the optimizer over the placed model, before a checkpoint is loaded into
        either: a task that moves parts of its model in and out of the device (:meth:`place_model`) moves their
        optimizer state with them. The default does nothing."""

    def repeated_blocks(self, model: Any) -> list[Any]:
        """The repeated blocks of ``model`` (what :meth:`~Task.build_model` made) that ``training.compile:
        regional`` compiles one by one (:func:`loongforge.train.compile.compile_blocks`): identical blocks share one
        compiled graph, so the compile time is that of one block.

        The default: the members of the model's outermost ``nn.ModuleList`` containers -- a DiT's transformer
        blocks, a policy's layers -- in model order. Override it where a model keeps its blocks otherwise."""
        from torch import nn

        blocks: list[Any] = []
        inside: set[int] = set()
        for module in model.modules():  # pre-order: a container comes before everything it holds
            if isinstance(module, nn.ModuleList) and id(module) not in inside:
                blocks.extend(module)
                inside.update(id(held) for held in module.modules())
        return blocks

    def validation_dataset(self, paths: list[str], samples: int) -> Any:
        """``evaluation.interval > 0``: a map-style dataset of validation items (the keys and shapes of
        :meth:`build_dataset`'s) of which the evaluation reads the first ``samples`` (fewer when it holds fewer).
        Called once, after :meth:`build_dataset`, so that what the task fitted on the training split (a
        normaliser's statistics) applies unchanged. ``paths`` is ``evaluation.data``, in the task's own data
        format; empty means the task's own held-out split. Raise a ``ConfigError`` when there is none.

        The default: the task has no validation data, and the run is refused in one line."""
        raise ConfigError(f"{type(self).__name__} has no validation data or loss; set evaluation.interval: 0")

    def validation_loss(self, model: Any, batch: dict[str, Any], generators: list[Any]) -> Any:
        """The scalar loss of one validation batch (the same kind of number :meth:`~Task.training_step` returns),
        called under ``torch.no_grad()`` with the model in eval mode. Every random draw the loss needs (noise,
        timesteps) comes from ``generators``, one seeded CPU ``torch.Generator`` per sample of the batch, the same
        at every evaluation; the task's own state (step count, streams) is left alone, and regularisation that
        exists only for training (caption dropout) is off, so the number is deterministic and training is
        unaffected."""
        raise NotImplementedError(f"{type(self).__name__} overrides validation_dataset but not validation_loss")

    def use_context_parallel(self, group: Any) -> None:
        """``parallel.cp > 1`` (called only when :attr:`context_parallel` is true), before ``build_model``: the
        ranks of ``group`` get the same batches and must together return the loss of the whole batch, each
        back-propagating its share of the gradient (the engine scales by cp before the strategy averages over all
        ranks)."""
        raise NotImplementedError(f"{type(self).__name__} sets context_parallel but does not implement it")

    def use_tensor_parallel(self, model: Any, mesh: Any) -> None:
        """``parallel.tp > 1`` (``parallel.strategy: fsdp2``; called only when :attr:`tensor_parallel` is true):
        split ``model``'s weights over the 1-D ``torch.distributed.DeviceMesh`` ``mesh`` in place, as DTensors (with
        ``torch.distributed.tensor.parallel``), before FSDP2 shards them over the other ranks. The ranks of ``mesh``
        get the same batches (and, with cp, the same tokens); each must return the whole loss, the same on all of
        them, and be left holding the full gradient of its slices (a replicated parameter's gradient whole)."""
        raise NotImplementedError(f"{type(self).__name__} sets tensor_parallel but does not implement it")


def check_task_parallel(task: Any, config: Any) -> None:
    """Refuse ``parallel.cp`` / ``parallel.tp`` above 1 for a task that does not declare the matching slot (one line);
    called by the task engine and by ``loongforge check``."""
    for key, declared in (("cp", task.context_parallel), ("tp", task.tensor_parallel)):
        size = getattr(config.parallel, key)
        if size > 1 and not declared:
            kind = "context" if key == "cp" else "tensor"
            raise ConfigError(f"{config.source}: parallel.{key}={size}: model '{config.model.name}' does not "
                              f"support {kind} parallelism")


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for one sample's random draws at one step, well mixed so neighbouring seeds share nothing.

    Seeding each sample from (run seed, step, dataset index) makes its draws the same whichever data-parallel
    rank trains it, so every layout trains the same run (what the torch-native strategies are tested against).
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


#: The ``step`` of :func:`sample_seed` an evaluation's draws use: training counts its steps from 1, so no training
#: step draws what an evaluation draws for the same sample index.
VALIDATION_STEP = 0


def sample_generators(seed: int, step: int, indices: Any) -> list[Any]:
    """One CPU ``torch.Generator`` per sample of a batch (``indices``: the batch's dataset indices), seeded by
    :func:`sample_seed`."""
    import torch

    return [torch.Generator().manual_seed(sample_seed(seed, step, int(i))) for i in indices.tolist()]
