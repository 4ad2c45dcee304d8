"""The declared base of every parallel strategy (``parallel.strategy``): which step engine it serves.

Why a declared attribute: megatron's strategy splits decoder layers into megatron-core process groups and the
torch-native ones (DDP, ZeRO-1, FSDP2, HSDP) wrap a plain ``torch.nn.Module``; they share a registry but not a
protocol. Core used to tell them apart by probing for an attribute only one of them had. Now each strategy states
:attr:`ParallelStrategy.engine` (one of :data:`loongforge.models.family.ENGINES`), and a run whose model is trained
by another engine fails in one line before anything is built. Torch-free, like every registered object's module
(and below :mod:`loongforge.models` in the import layers: it names the engines as strings).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from loongforge.errors import ConfigError


class ParallelStrategy(abc.ABC):
    """Base of every registered strategy (a subclass, or an instance of one)."""

    #: The step engine whose models this strategy lays out: ``"megatron"`` or ``"task"`` (the names of
    #: ``loongforge.models.family.ENGINES``). Every subclass sets it; the empty default is refused.
    engine: ClassVar[str] = ""

    @abc.abstractmethod
    def validate(self, parallel: Any, world_size: int, source: str) -> Any:
        """The validated layout for ``world_size`` processes; a one-line :class:`ConfigError` if impossible."""


def check_strategy(strategy: Any, name: str, engine: str, where: str, model: str) -> ParallelStrategy:
    """``strategy`` (a registered class or instance) if it is a :class:`ParallelStrategy` serving ``engine``;
    otherwise a one-line :class:`ConfigError` naming ``where`` (e.g. "parallel.strategy in run.yaml")."""
    cls = strategy if isinstance(strategy, type) else type(strategy)
    if not issubclass(cls, ParallelStrategy):
        raise ConfigError(f"{where}: '{name}' resolved to {cls.__name__}, which is not a "
                          "loongforge.parallel.strategy.ParallelStrategy")
    if not cls.engine:
        raise ConfigError(f"{where}: strategy '{name}' ({cls.__name__}) declares no engine")
    if cls.engine != engine:
        raise ConfigError(f"{where}: strategy '{name}' lays out {cls.engine}-engine models, but model "
                          f"'{model}' is trained by the {engine} engine (`loongforge list strategies`)")
    return strategy
