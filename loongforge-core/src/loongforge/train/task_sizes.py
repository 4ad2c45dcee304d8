"""What the task engine asks of a task's data sizes, said by the family's pre-flight before anything is built.

Why here: the task engine (:mod:`loongforge.train.engines.task`) finds a data set smaller than one batch only after it
has built the model (its batch order, its validation batches), and a family's ``check_task`` knows its data's sizes
before that. This states the engine's requirement once, in the engine's own words, for every family to call.
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError
from loongforge.train.batches import validation_batch_count


def check_data_sizes(config: Any, train: tuple[int, str], validation: tuple[int, str] | None = None) -> None:
    """What the task engine asks of a task's data sizes, for the family's pre-flight (``check_task``) to say before
    anything is built: ``train`` -- (samples, where they are: ``run.yaml: task.data DIR``) -- fills one
    step's batch of ``training.micro_batch_size`` (per data-parallel rank: ``check_task`` is not told the world
    size, so one rank's), and, when the run evaluates, ``validation`` -- (samples, where they come from) -- one
    validation batch. Each shortfall is the one-line ``ConfigError`` training would otherwise raise after building
    the model."""
    batch = config.training.micro_batch_size
    count, where = train
    if count < batch:
        raise ConfigError(f"{where}: {count} training sample(s), fewer than "
                          f"training.micro_batch_size ({batch}): no step could fill its batch")
    if validation is not None:
        validation_batch_count(config, validation[0], batch, validation[1])
