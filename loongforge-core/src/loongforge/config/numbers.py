"""What core holds the numbers of a model family's ``task:`` section to, whatever the family declared: every float
finite, and -- for the family to pass its conformance suite -- every number inside a declared range
(:func:`~loongforge.config.sections.ranged`).

Why core says it rather than each plugin: a NaN or an infinity is never a setting (``task.sample.guidance: .nan``
used to sample black videos, exit 0 and write a bare ``NaN`` into ``samples/index.json``), and a range a family
forgot to declare is an option ``check`` cannot refuse. :func:`check_finite` runs on every ``task:`` section core
builds (:func:`loongforge.config.plugin_sections.task_options`), so even an undeclared float cannot be NaN;
:func:`unranged_numbers` is what the family suite (:mod:`loongforge.testing.family_suite`) asks of
``task_options``, so a new option without a range fails the family's own tests, not a user's run.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from loongforge.config.sections import RANGE, origin_of
from loongforge.errors import ConfigError


def check_finite(section: Any, source: str, key: str) -> None:
    """Raise a one-line :class:`ConfigError` naming the key of the first float of the section instance ``section``
    (nested sections, lists, tuples and mappings included) that is NaN or infinite."""
    for path, value in _numbers(section, key):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{origin_of(source, path)}: '{path}' must be a finite number, got {value!r}")


def _numbers(value: Any, key: str) -> typing.Iterator[tuple[str, Any]]:
    """``(key path, value)`` of every number under ``value`` (an item of a list is named by its key)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{key}.{f.name}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item, key)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield key, value


def unranged_numbers(cls: type, key: str = "task") -> list[str]:
    """Dotted keys of the ``int`` / ``float`` fields of the section dataclass ``cls`` (nested sections too, also
    optional ones) that declare no range: each an option ``check`` cannot hold to what the family can train."""
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        alternatives = union_members(hints[f.name])
        if any(a in (int, float) for a in alternatives) and RANGE not in f.metadata:
            missing.append(f"{key}.{f.name}")
        for nested in (a for a in alternatives if dataclasses.is_dataclass(a)):
            missing += unranged_numbers(nested, f"{key}.{f.name}")
    return missing


def union_members(hint: Any) -> tuple[Any, ...]:
    """The types a type hint admits: the members of a union (``X | None``), else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)
