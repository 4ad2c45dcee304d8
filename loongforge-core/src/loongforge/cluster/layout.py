"""The one check every launcher runs before it prints anything: the config's parallel layout fits the ranks the
job will start (nodes x processes per node), as ``loongforge train --nproc`` checks it before starting them -- so
a wrong ``tp`` fails here in a second, not on the cluster after the job waited in the queue."""

from __future__ import annotations

from typing import Any


def check_layout(config: Any, world_size: int) -> None:
    """Raise the strategy's one-line :class:`~loongforge.errors.ConfigError` unless ``config.parallel`` fits
    ``world_size`` ranks."""
    from loongforge.plugins import get_registry

    strategy = get_registry("strategy").load(config.parallel.strategy, where=f"parallel.strategy in {config.source}")
    strategy.validate(config.parallel, world_size, config.source)
