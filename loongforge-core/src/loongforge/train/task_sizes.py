"""What the task engine asks of a task's data sizes, said by the family's pre-flight before anything is built.

Why here: the task engine (:mod:`loongforge.train.engines.task`) finds a data set smaller than one batch only after it
has built the model (its batch order, its validation batches), and a family's ``check_task`` knows its data's sizes
before that. This states the engine's requirement once, in the engine's own words, for every family to call. The
pre-flight runs ``check_task`` inside :func:`data_parallel` with the layout's data-parallel size (``check_task`` is
not told the world size), so a step's batch is the one the engine will draw: ``micro_batch_size`` on each rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from loongforge.errors import ConfigError
from loongforge.train.batches import validation_batch_count

#: Data-parallel ranks of the run being checked (set by the pre-flight around ``check_task``; 1 elsewhere).
_DATA_PARALLEL: ContextVar[int] = ContextVar("loongforge_data_parallel", default=1)


@contextlib.contextmanager
def data_parallel(ranks: int) -> Iterator[None]:
    """Within the block, :func:`check_data_sizes` holds data to batches of ``ranks`` data-parallel ranks."""
    token = _DATA_PARALLEL.set(ranks)
    try:
        yield
    finally:
        _DATA_PARALLEL.reset(token)


def check_data_sizes(config: Any, train: tuple[int, str], validation: tuple[int, str] | None = None) -> None:
    """What the task engine asks of a task's data sizes, for the family's pre-flight (``check_task``) to say before
    anything is built: ``train`` -- (samples, where they are: ``run.yaml: task.data DIR``) -- fills one
    step's batch (``training.micro_batch_size`` on each data-parallel rank, :func:`data_parallel`), and, when the
    run evaluates, ``validation`` -- (samples, where they come from) -- one validation batch. Each shortfall is the
    one-line ``ConfigError`` training would otherwise raise after building the model."""
    ranks = _DATA_PARALLEL.get()
    batch = config.training.micro_batch_size * ranks
    count, where = train
    if count < batch:
        per_rank = f" x {ranks} data-parallel ranks" if ranks > 1 else ""
        raise ConfigError(f"{where}: {count} training sample(s), fewer than training.micro_batch_size "
                          f"({config.training.micro_batch_size}){per_rank}: no step could fill its batch")
    if validation is not None:
        validation_batch_count(config, validation[0], batch, validation[1])
