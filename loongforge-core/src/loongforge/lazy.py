"""Lazy package exports: a package lists its public names and the submodule each lives in, and importing the
package stays free (no torch, numpy, PIL, ...) until a name is first used -- what keeps ``loongforge`` and plugin
registration instant."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``name`` is imported from ``package.<exports[name]>``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
