"""A lighter import of megatron-core: what it loads at import time and LoongForge never uses.

Importing ``megatron.core`` costs ~155 MiB of RSS and ~3 s, against ~47 MiB of tensors for the tiny Llama the
benchmarks train. The import-time choices below account for ~90 MiB and over 2 s of that, and none does anything
on LoongForge's path:

* ``megatron.core.jit`` binds ``jit_fuser = torch.compile``, and its fusion helpers are decorated with it as their
  modules load. ``torch.compile(fn)`` imports dynamo, Inductor and sympy on the spot (~70 MiB, ~1.5 s) although
  compiling only happens at a first call, and the local/CPU layers never call those helpers. Here
  ``jit_fuser`` becomes :func:`deferred_compile`: the same ``torch.compile`` with the same arguments, made at the
  helper's first call instead of at decoration. Inside a graph being traced the helper runs as written, which is
  what dynamo inlines anyway; and a device backend whose compiler buys nothing for these small helpers (the CPU
  backend) turns compiling off with :func:`compile_fusion_helpers`, so they run as written everywhere.
* ``megatron.core.timers`` and the dynamic inference engine import ``wandb`` if it is installed (~20 MiB, 0.5 s),
  and the timers also ``torch.utils.tensorboard`` (protobuf, absl and TensorBoard's TensorFlow stub: ~0.25 s), for
  writers LoongForge never hands them (its own trackers log; see :mod:`loongforge.train.trackers`). While those
  modules load, these read as absent -- the branch megatron takes when they are not installed. A module imported
  before keeps its place (nothing is hidden then), and one imported after is the real one.

:func:`install` puts a meta-path finder in front that touches only the modules of :data:`ADJUSTMENTS`, as each
loads; :mod:`loongforge` installs it on import, so it is in place before any LoongForge module imports megatron.
If megatron was imported before LoongForge, nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Adjustment:
    """What :class:`MegatronImportFinder` does around one megatron module's execution."""

    #: Modules that read as not installed while it executes (unless already imported).
    hidden: tuple[str, ...] = ()
    #: Called with the executed module.
    after: Callable[[ModuleType], None] | None = None


#: Whether :func:`deferred_compile` helpers compile at their first call (see :func:`compile_fusion_helpers`).
_compile_helpers = True


def compile_fusion_helpers(enabled: bool) -> None:
    """Whether megatron's ``jit_fuser`` helpers compile at first call (``True``) or run as written (``False``).

    A process-wide switch for device backends (``DeviceBackend.apply_patches``): the helpers are elementwise
    glue (router bias, dispatch preprocessing, norms, output gates) whose compiled and eager results agree.
    """
    global _compile_helpers
    _compile_helpers = enabled


def deferred_compile(fn: Callable | None = None, **options: Any) -> Any:
    """``torch.compile`` made at the first call of ``fn`` (decorator form with or without options)."""
    if fn is None:
        return functools.partial(deferred_compile, **options)
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        import torch

        if not _compile_helpers or torch.compiler.is_compiling():  # eager device, or an enclosing graph traces it
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return call


@contextlib.contextmanager
def _modules_hidden(names: tuple[str, ...]) -> Iterator[None]:
    """Importing any of ``names`` raises ImportError inside (unless it was already imported); restored after."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not importable" mark
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


def _defer_jit_fuser(module: ModuleType) -> None:
    import torch

    if module.jit_fuser is torch.compile:
        module.jit_fuser = deferred_compile


#: Writers' libraries the timers and the dynamic inference engine import for features LoongForge does not use.
_UNUSED_WRITERS = ("wandb",)

#: megatron module name -> what to do around its execution.
ADJUSTMENTS: dict[str, Adjustment] = {
    "megatron.core.jit": Adjustment(after=_defer_jit_fuser),
    "megatron.core.timers": Adjustment(hidden=(*_UNUSED_WRITERS, "torch.utils.tensorboard")),
    "megatron.core.inference.contexts.dynamic_context": Adjustment(hidden=_UNUSED_WRITERS),
    "megatron.core.inference.engines.dynamic_engine": Adjustment(hidden=_UNUSED_WRITERS),
}


class _AdjustingLoader(importlib.abc.Loader):
    """The module's own loader, run with its :class:`Adjustment`."""

    def __init__(self, loader: importlib.abc.Loader, adjustment: Adjustment) -> None:
        self._loader = loader
        self._adjustment = adjustment

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _modules_hidden(self._adjustment.hidden):
            self._loader.exec_module(module)
        if self._adjustment.after is not None:
            self._adjustment.after(module)


class MegatronImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`ADJUSTMENTS` through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in ADJUSTMENTS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AdjustingLoader(spec.loader, ADJUSTMENTS[fullname])
                return spec
        return None


def install() -> None:
    """Put :class:`MegatronImportFinder` first on ``sys.meta_path`` (once; a no-op after megatron is imported)."""
    if "megatron.core" in sys.modules or any(isinstance(f, MegatronImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, MegatronImportFinder())
