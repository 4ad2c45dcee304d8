"""One way for the CPU patches to put a replacement where megatron looks a function up, once.

A replacement is made from megatron's function (``wrap(original)``) and remembers it as ``megatron_original``,
which is also how a second application recognises its own work and leaves it alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def replace_once(module_name: str, attribute: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Set ``module.attribute`` to ``wrap(current)`` unless it already is such a replacement (idempotent)."""
    module = importlib.import_module(module_name)
    current = getattr(module, attribute)
    if getattr(current, "megatron_original", None) is not None:
        return
    replacement = wrap(current)
    replacement.megatron_original = current  # type: ignore[attr-defined]
    setattr(module, attribute, replacement)
