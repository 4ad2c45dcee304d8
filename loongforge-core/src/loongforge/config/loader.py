"""YAML files and ``key=value`` overrides -> a validated :class:`LoongForgeConfig`.

Validation is strict on purpose: an unknown key is almost always a typo that would otherwise silently
fall back to a default and waste a training run. Every error names the file and the dotted key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from loongforge.config.schema import COMPOSED_MODEL, PART_ROLES, LoongForgeConfig, ModelConfig, ParallelConfig
from loongforge.errors import ConfigError

#: Sections that may be written as a bare name instead of a mapping (``model: qwen3-0.6b``).
_NAME_SHORTHAND = {"model": ModelConfig}
#: Sections that may be written as one word meaning a mapping (``parallel: auto`` = ``{auto: true}``).
_WORD_SHORTHAND = {"parallel": (ParallelConfig, "auto", {"auto": True})}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LoongForgeConfig:
    """Read ``path`` (or start from defaults), apply ``a.b=c`` overrides, and return a typed config."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw = read_yaml_mapping(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    model = raw.get("model")
    if isinstance(model, dict) and "name" not in model and any(role in model for role in PART_ROLES):
        raw["model"] = {"name": COMPOSED_MODEL, **model}  # parts alone compose a vision-language model
    config = _build(LoongForgeConfig, raw, source, prefix="")
    config.source = source
    return config


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse a YAML file that must hold a mapping, with one-line errors for the usual mistakes."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain-data view of a config (for saving the resolved config next to checkpoints)."""
    data = dataclasses.asdict(config)
    data.pop("source", None)
    return data


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. training.steps=100")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, str) and part in _NAME_SHORTHAND and depth == 0:
            child = {"name": child}
        elif depth == 0 and part in _WORD_SHORTHAND and child == _WORD_SHORTHAND[part][1]:
            child = dict(_WORD_SHORTHAND[part][2])
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    if isinstance(data, str) and cls in _NAME_SHORTHAND.values():
        data = {"name": data}
    for shorthand_cls, word, mapping in _WORD_SHORTHAND.values():
        if cls is shorthand_cls and data == word:
            data = dict(mapping)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = f"{prefix}{unknown[0]}"
        known = ", ".join(fields)
        raise ConfigError(f"{source}: unknown key '{key}' (known keys here: {known})")
    kwargs = {name: _convert(hints[name], value, source, f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value, source, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, f"{key}.")
    if origin is list:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{key}' must be a list, got {value!r}")
        return [_convert(args[0], v, source, key) for v in value] if args else value
    if origin is dict or hint is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' must be a mapping, got {value!r}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: '{key}' must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{source}: '{key}' must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: '{key}' must be a string, got {value!r}")
    return value
