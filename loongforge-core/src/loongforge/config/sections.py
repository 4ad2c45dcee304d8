"""A mapping from YAML -> an instance of a config dataclass, checked key by key: core's sections and plugins' alike.

Why one mechanism: a plugin's ``task:``, ``device_options:`` or ``optimizations.<name>:`` section deserves the same
errors as core's own (unknown key with did-you-mean and the known keys, wrong type, bad choice), each naming the
file and the full key path, so that a typo fails in one line before a run starts instead of being ignored or
crashing deep inside a plugin. A section is a dataclass; its field types say what is accepted:

- ``bool``, ``int``, ``float`` (an int or a numeric string such as YAML 1.1's ``3e-4``), ``str``, ``Any``;
- ``X | None`` and unions (the first alternative that accepts the value wins), ``Literal[...]`` (a choice);
- ``list[X]`` (a scalar becomes a one-item list), ``tuple[X, ...]`` / ``tuple[X, Y]`` (from a YAML list),
  ``dict[str, X]``, nested dataclasses.

A field whose metadata has :data:`OTHER_KEYS` set collects the keys that are no field (a composed model's parts
under ``model:``); it is not a key itself, nor is a field marked :data:`INTERNAL`. ``__post_init__`` may raise
:class:`ConfigError` (or ``ValueError``) for values the types cannot express; the message is prefixed with the file
and the section's key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from loongforge.errors import ConfigError

#: Field metadata key: the field gathers every key of the mapping that is not a field (see the module docstring).
OTHER_KEYS = "loongforge_other_keys"
#: Field metadata key: the field's value (when set) names a file or directory that must exist before a run starts;
#: ``loongforge check`` and ``train`` look for it (see :func:`path_field`).
EXISTING_PATH = "loongforge_existing_path"

#: Field metadata key: the field is set by code (where a config was read from), never by a key of the mapping.
INTERNAL = "loongforge_internal"
#: Field metadata key: the :class:`Range` a number given in the config must lie in (:func:`ranged`).
RANGE = "loongforge_range"

#: ``normalize(cls, data) -> data``: rewrites a section's raw value before it is checked (core's shorthands).
Normalizer = Callable[[type, Any], Any]


#: How errors name the ``key=value`` overrides of a command (see :class:`ConfigSource`).
COMMAND_LINE = "command line"


class ConfigSource(str):
    """Where a config was read -- a YAML path or ``<defaults>`` -- that also knows which keys the command line's
    ``key=value`` overrides set, so that an error about such a key blames the command line, not a file that never
    held the typo (:meth:`of`).

    It is a ``str`` (the file's name) so that every message naming ``config.source`` reads as it always did;
    messages about one key ask :func:`origin_of` instead.
    """

    overrides: tuple[tuple[str, str], ...]
    file_keys: frozenset[str]

    def __new__(cls, file: str, overrides: tuple[tuple[str, str], ...] = (),
                file_keys: frozenset[str] = frozenset()) -> ConfigSource:
        """``overrides``: ``(dotted key, "key=value" as typed)`` in command-line order; ``file_keys``: every dotted
        key path the file itself holds."""
        made = super().__new__(cls, file)
        made.overrides = tuple(overrides)
        made.file_keys = frozenset(file_keys)
        return made

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles keep the override record
        return (ConfigSource, (str(self), self.overrides, self.file_keys))

    def of(self, key: str) -> str:
        """Who set ``key`` (dotted; ``""`` is the whole config): the command line when an override set it or a
        mapping holding it (the last such override), or set keys under it that the file lacks; the file *with*
        those overrides when both made the value; else the file."""
        key = key.split("[", 1)[0]  # 'data.paths[0]': an item of the list a key holds
        involved = []
        for override_key, item in reversed(self.overrides):
            if key == override_key or key.startswith(f"{override_key}."):
                return f"{COMMAND_LINE} ({item})"
            if not key or override_key.startswith(f"{key}."):
                involved.append(item)
        if not involved:
            return str(self)
        items = ", ".join(reversed(involved))
        both = not key or key in self.file_keys
        return f"{self} with {COMMAND_LINE} ({items})" if both else f"{COMMAND_LINE} ({items})"


def origin_of(source: str, key: str) -> str:
    """The origin to name in an error about ``key``: :meth:`ConfigSource.of` for a config read with overrides, else
    ``source`` itself (a plugin's own file, a checkpoint's config.yaml)."""
    return source.of(key) if isinstance(source, ConfigSource) else source


def build_section(cls: type, data: Any, source: str, key: str = "", normalize: Normalizer | None = None) -> Any:
    """An instance of the dataclass ``cls`` from ``data``; ``key`` is the section's dotted path (``""``: the top
    level, ``"task"``, ``"optimizations.dp-balance"``) and ``source`` the file, both named in every error."""
    if normalize is not None:
        data = normalize(cls, data)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin_of(source, key)}: '{key or '<top>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get(INTERNAL)]
    named = {f.name: f for f in fields if not f.metadata.get(OTHER_KEYS)}
    rest = next((f.name for f in fields if f.metadata.get(OTHER_KEYS)), None)
    prefix = f"{key}." if key else ""
    unknown = [str(k) for k in data if k not in named]
    if unknown and rest is None:
        raise unknown_key_error(f"{prefix}{unknown[0]}", unknown[0], list(named), source)
    missing = [name for name, f in named.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{origin_of(source, key)}: '{prefix}{missing[0]}' is required (in '{key or '<top>'}')")
    kwargs = {name: convert(hints[name], value, source, f"{prefix}{name}", normalize)
              for name, value in data.items() if name in named}
    for name, value in kwargs.items():
        _check_range(named[name], value, source, f"{prefix}{name}")
    if rest is not None:
        kwargs[rest] = {str(k): v for k, v in data.items() if k not in named}
    try:
        return cls(**kwargs)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{origin_of(source, key)}: {key or '<top>'}: {exc}") from None


@dataclass(frozen=True)
class Range:
    """Where a number of a typed section must lie: above ``low`` and below ``high`` (either may be ``None``),
    ``open`` at an end the value may not equal; always finite."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (value > self.high or (self.high_open and value == self.high))

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a finite number"
        low, high = _bound(self.low), _bound(self.high)
        if self.low is not None and self.high is not None:
            return f"{kind} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {high}"
        return kind


def _bound(value: float | None) -> str:
    """A bound as a reader writes it: whole numbers in full (``2147483648``, not ``2.14748e+09``)."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def ranged(default: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> Any:
    """A dataclass field of a number that must lie in a range when a config sets it: what ``check`` and ``train``
    refuse in one line naming the key (``task.sample.steps must be an integer >= 1, got 0``), so a plugin's
    options are range-checked by core like core's own (NaN and infinities never pass)."""
    return dataclasses.field(default=default, metadata={RANGE: Range(low, high, low_open, high_open)})


def _check_range(f: dataclasses.Field, value: Any, source: str, key: str) -> None:
    span = f.metadata.get(RANGE)
    if span is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not span.contains(value):
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be {span.describe(isinstance(value, int))}, "
                          f"got {value!r}")


def path_field(default: str | None = None) -> Any:
    """A dataclass field (``str | None``) naming a file or directory that must exist when set: a plugin marks its
    data and weights paths with it so a missing one fails the pre-flight check in one line."""
    return dataclasses.field(default=default, metadata={EXISTING_PATH: True})


def named_paths(section: Any, key: str) -> list[tuple[str, str]]:
    """``(key path, value)`` of every :func:`path_field` set in the section instance ``section`` (nested too)."""
    found = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.metadata.get(EXISTING_PATH) and value:
            found.append((f"{key}.{f.name}", str(value)))
        elif dataclasses.is_dataclass(value):
            found.extend(named_paths(value, f"{key}.{f.name}"))
    return found


def unknown_key_error(path: str, name: str, known: list[str], source: str) -> ConfigError:
    """``unknown key 'a.b' (known keys here: ...)``, with a did-you-mean when one known key is close."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{origin_of(source, path)}: unknown key '{path}' (known keys here: "
                       f"{', '.join(known) or 'none'}){hint}")


def section_to_dict(obj: Any) -> Any:
    """Plain data for a section instance, the inverse of :func:`build_section` (:data:`OTHER_KEYS` fields are
    spread back into their section), so a saved config loads again."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = section_to_dict(getattr(obj, f.name))
            if f.metadata.get(OTHER_KEYS):
                out.update(value)
            elif f.init and not f.metadata.get(INTERNAL):
                out[f.name] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [section_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: section_to_dict(v) for k, v in obj.items()}
    return obj


def convert(hint: Any, value: Any, source: str, key: str, normalize: Normalizer | None = None) -> Any:
    """``value`` checked (and coerced where YAML is loose) against the type ``hint`` of the key ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(args, value, source, key, normalize)
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.6)
        hint_text = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be one of {', '.join(map(str, args))}, "
                          f"got {value!r}{hint_text}")
    if dataclasses.is_dataclass(hint):
        return build_section(hint, value, source, key, normalize)
    if origin is list or hint is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a list, got {value!r}")
        return [convert(args[0], v, source, key, normalize) for v in value] if args else value
    if origin is tuple:
        return _convert_tuple(args, value, source, key, normalize)
    if origin is dict or hint is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a mapping, got {value!r}")
        if len(args) == 2:
            return {k: convert(args[1], v, source, f"{key}.{k}", normalize) for k, v in value.items()}
        return value
    return _convert_scalar(hint, value, source, key)


def _convert_union(args: tuple[Any, ...], value: Any, source: str, key: str, normalize: Normalizer | None) -> Any:
    if value is None and type(None) in args:
        return None
    alternatives = [a for a in args if a is not type(None)]
    errors = []
    for alternative in alternatives:
        try:
            return convert(alternative, value, source, key, normalize)
        except ConfigError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    words = [word for alternative in alternatives for word in _words(alternative)]
    close = difflib.get_close_matches(str(value), words, n=1, cutoff=0.6) if isinstance(value, str) else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"{origin_of(source, key)}: '{key}' must be {' or '.join(_type_name(a) for a in alternatives)}, "
                      f"got {value!r}{hint}")


def _words(hint: Any) -> list[str]:
    """The spellings a type accepts as a bare word (a did-you-mean for a misspelt one): a Literal's choices, YAML's
    true/false for a bool."""
    if hint is bool:
        return ["true", "false"]
    return [str(a) for a in typing.get_args(hint)] if typing.get_origin(hint) is Literal else []


def _convert_tuple(args: tuple[Any, ...], value: Any, source: str, key: str, normalize: Normalizer | None) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a list, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(convert(args[0], v, source, key, normalize) for v in value)
    if args and len(args) != len(value):
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a list of {len(args)} values, got {value!r}")
    return tuple(convert(a, v, source, key, normalize) for a, v in zip(args, value, strict=True)) if args else value


def _convert_scalar(hint: Any, value: Any, source: str, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond any float
                raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a number a float can hold, "
                                  f"got {value!r}") from None
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{origin_of(source, key)}: '{key}' must be a string, got {value!r}")
    return value


def _type_name(hint: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if typing.get_origin(hint) is Literal:
        return f"one of {', '.join(map(str, typing.get_args(hint)))}"
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return "a mapping"
    return "a list" if typing.get_origin(hint) in (list, tuple) else getattr(hint, "__name__", str(hint))
