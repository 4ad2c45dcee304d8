"""The optimization contract: what ``loongforge_register_optimizations`` registers and ``optimizations:`` enables.

Why a base class with declared slots: an optimization's settings (``optimizations.<name>: {...}``) used to be an
untyped mapping each plugin checked by hand, so ``loongforge check`` could not see a typo in them. A registered
optimization is a subclass of :class:`Optimization` that names its options dataclass in :attr:`options_type`;
core validates the section against it like its own sections (unknown key with did-you-mean, types, the
dataclass's ``__post_init__`` checks) when a config is checked and again when the run enables it, and the
instance reads typed values from :attr:`Optimization.options`. Its hook implementations (``@hookimpl`` methods)
are registered for the run.

Torch-free: ``loongforge check`` loads optimization classes to read their slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from loongforge.config.sections import build_section
from loongforge.errors import ConfigError


class Optimization:
    """Base of every registered optimization; subclasses set the class slots and read ``self.options``."""

    #: The registered name (``optimizations.<name>``), used in messages.
    name: ClassVar[str] = ""
    #: The dataclass of the ``optimizations.<name>:`` section; ``None``: the optimization takes no options.
    options_type: ClassVar[type | None] = None

    def __init__(self, options: Mapping[str, Any] | None = None, *, source: str = "config") -> None:
        #: The validated section (an instance of :attr:`options_type`), ``None`` when it takes no options.
        self.options: Any = optimization_options(type(self), options, source, f"optimizations.{self.name}")


def optimization_options(cls: type[Optimization], options: Mapping[str, Any] | None, source: str, key: str) -> Any:
    """The section ``key`` (``optimizations.<name>``) of ``source`` as an instance of ``cls.options_type``."""
    given = dict(options or {})
    if cls.options_type is None:
        if given:
            raise ConfigError(f"{source}: unknown key '{key}.{sorted(given)[0]}' ({key} takes no options)")
        return None
    return build_section(cls.options_type, given, source, key)


def check_optimization(obj: Any, name: str, where: str) -> type[Optimization]:
    """``obj`` (what the registry holds for ``name``) if it is an :class:`Optimization` subclass, else a one-line
    :class:`ConfigError` naming ``where``."""
    if not (isinstance(obj, type) and issubclass(obj, Optimization)):
        raise ConfigError(f"{where}: optimization '{name}' is registered as {obj!r}, which is not a subclass of "
                          "loongforge.optimizations.Optimization (see docs/plugin-authors.md)")
    return obj
