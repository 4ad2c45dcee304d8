"""Tasks: how model kinds other than megatron decoders (diffusion DiTs, later VLA policies) plug into ``train``.

A registered model object that has a ``make_task(config)`` method is trained by
:func:`loongforge.train.task_loop.run_task` instead of the megatron GPT path. The task owns everything that is
specific to its model kind -- building the model and the dataset, the loss of one batch, the random streams
it draws from, and what to do after training (write samples, score them) -- while core owns the loop,
optimizer, schedule, checkpoints, resume, metrics and progress, exactly as for LLMs. The task's options live
under ``task:`` in the run config; the task validates them and names an unknown key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from loongforge.errors import ConfigError


@runtime_checkable
class Task(Protocol):
    """What :func:`~loongforge.train.task_loop.run_task` needs from a model kind."""

    def build_model(self) -> Any:
        """A freshly initialised ``torch.nn.Module`` (seeded by the caller)."""

    def build_dataset(self) -> Any:
        """A map-style dataset whose items are dicts of tensors of equal shapes (stacked into batches)."""

    def training_step(self, model: Any, batch: dict[str, Any]) -> Any:
        """The scalar loss of one batch; the loop runs backward and the optimizer."""

    # Optional: ``after_step(model)``, called after each optimizer step (EMA updates and the like).
    # Optional: ``use_context_parallel(group)``, called before ``build_model`` when ``parallel.cp > 1``: the ranks
    # of ``group`` get the same batches and must together return the loss of the whole batch, each back-propagating
    # its share of the gradient (the loop scales by cp before the strategy averages over all ranks).

    def state_dict(self) -> dict[str, Any]:
        """The task's own random streams (tensors/ints only), saved in checkpoints for bit-exact resume."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def finish(self, model: Any, output_dir: Path) -> dict[str, Any]:
        """After the last step: write samples or evaluate; the returned entries join the run summary."""

    def sample_files(self, model: Any, prompts: list[str], out_dir: Path, *, steps: int, guidance: float, seed: int,
                     fmt: str) -> list[Path]:
        """``loongforge sample``: one file per prompt (``fmt`` gif, mp4 or png) written under ``out_dir``."""


def task_for(model_object: Any, config: Any) -> Task | None:
    """The task of a registered model object, or ``None`` for a megatron decoder flavor."""
    make_task = getattr(model_object, "make_task", None)
    return make_task(config) if callable(make_task) else None


def checked_options(options: dict[str, Any], known: dict[str, Any], where: str) -> dict[str, Any]:
    """A task's ``options`` over its defaults ``known``; an unknown key is a one-line error naming it and
    ``where`` (e.g. "task in run.yaml"), as every task must do for ``task:``."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return {**known, **options}


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for one sample's random draws at one step, well mixed so neighbouring seeds share nothing.

    Seeding each sample from (run seed, step, dataset index) makes its draws the same whichever data-parallel
    rank trains it, so every layout trains the same run (what the torch-native strategies are tested against).
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_generators(seed: int, step: int, indices: Any) -> list[Any]:
    """One CPU ``torch.Generator`` per sample of a batch (``indices``: the batch's dataset indices), seeded by
    :func:`sample_seed`."""
    import torch

    return [torch.Generator().manual_seed(sample_seed(seed, step, int(i))) for i in indices.tolist()]
