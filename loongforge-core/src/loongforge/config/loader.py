"""YAML files and ``key=value`` overrides -> a validated :class:`LoongForgeConfig`.

Validation is strict on purpose: an unknown key is almost always a typo that would otherwise silently
fall back to a default and waste a training run. Every error names the dotted key path and where it was set: the
file, or the command line for a key an override set (:class:`~loongforge.config.sections.ConfigSource`). The YAML
itself is read by :mod:`loongforge.config.strict_yaml` (``safe_load`` that also refuses duplicate keys, deep
nesting and runaway aliases), for files and for override values alike, and must be UTF-8.

A file may start from others: ``base: common.yaml`` (or a list, applied in order; paths relative to the file)
reads those first and lays the file's own keys over them -- mappings merged key by key, any other value replaced --
so a family of runs shares one recipe and states only what differs. Bases may have bases; a cycle is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loongforge.config import strict_yaml
from loongforge.config.schema import MODEL_KEYS, LoongForgeConfig, ModelConfig, ParallelConfig
from loongforge.config.sections import COMMAND_LINE, ConfigSource, build_section, section_to_dict
from loongforge.errors import ConfigError

#: Sections that may be written as a bare name instead of a mapping (``model: qwen3-0.6b``).
_NAME_SHORTHAND = {"model": ModelConfig}
#: Sections that may be written as one word meaning a mapping (``parallel: auto`` = ``{auto: true}``).
_WORD_SHORTHAND = {"parallel": (ParallelConfig, "auto", {"auto": True})}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LoongForgeConfig:
    """Read ``path`` (or start from defaults), apply ``a.b=c`` overrides, and return a typed config."""
    raw: dict[str, Any] = {}
    file = "<defaults>"
    if path is not None:
        file = str(path)
        raw = read_with_bases(Path(path))
        if not raw and not overrides:  # a failed redirect or the wrong file, not "train the defaults"
            raise ConfigError(f"{path}: the config file holds no settings; name at least the model "
                              "(model: NAME), or start from another config (base: FILE)")
    file_keys = frozenset(_key_paths(raw))
    for item in overrides:
        _apply_override(raw, item)
    source = ConfigSource(file, tuple((item.partition("=")[0], item) for item in overrides), file_keys)
    config = build_section(LoongForgeConfig, raw, source, normalize=_shorthands)
    config.source = source
    return config


def load_checkpoint_config(path: str | Path, *, trust_code: bool) -> LoongForgeConfig:
    """The run config a checkpoint recorded (``path``: its config.yaml).

    Whoever made the checkpoint wrote this file, so its ``pkg.module:attr`` names may import (run) their module only
    when the user trusts the checkpoint: ``trust_code`` comes from the user (``--trust-code``, or ``run.trust_code``
    in their own config), never from the file, whose recorded ``run.trust_code`` is ignored. The decision travels
    with the config as :attr:`LoongForgeConfig.code_trusted`, which name resolution (:mod:`loongforge.resolve`) obeys.
    """
    config = load_config(path)
    config.code_trusted = trust_code
    return config


#: The top-level key naming the file(s) a config starts from.
BASE_KEY = "base"


def read_with_bases(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """``path``'s mapping laid over the mappings its ``base:`` names (recursively), ``base`` itself removed."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"{path}: base: the configs name each other in a circle ({cycle})")
    raw = read_yaml_mapping(path)
    bases = raw.pop(BASE_KEY, None)
    if bases is None:
        return raw
    names = [bases] if isinstance(bases, str) else bases
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{path}: base must name a config file or a list of them, got {bases!r}")
    merged: dict[str, Any] = {}
    for name in names:
        base = (path.parent / name).expanduser()
        if not base.is_file():
            raise ConfigError(f"{path}: base {name!r}: no such config file ({base})")
        merged = _merged(merged, read_with_bases(base, (*chain, resolved)))
    return _merged(merged, raw)


def _merged(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``under``: mappings merged key by key, other values replaced."""
    out = dict(under)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse a YAML file that must hold a mapping, with one-line errors for the usual mistakes."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save the file as UTF-8") from None
    try:
        data = strict_yaml.load(text)
    except strict_yaml.YAMLRefusal as exc:
        where = f":{exc.line}" if exc.line is not None else ""
        raise ConfigError(f"{path}{where}: {exc}") from None
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
    return section_to_dict(config)


def _key_paths(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key path of a YAML mapping (into nested mappings), for :class:`ConfigSource`."""
    paths = []
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict):
            paths += _key_paths(value, f"{path}.")
    return paths


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Set one ``a.b=c`` override in ``raw``; its own mistakes are the command line's (so say that)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: expected key=value, e.g. training.steps=100")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: not valid UTF-8") from None
    try:
        value = strict_yaml.load(text) if text else ""
    except strict_yaml.YAMLRefusal as exc:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: {exc}") from None
    except yaml.YAMLError:  # not YAML: the text itself (a prompt such as "Q: why?")
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
            raise ConfigError(f"{COMMAND_LINE}: override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value


def _shorthands(cls: type, data: Any) -> Any:
    """Core's shorthands: ``model: NAME``, ``parallel: auto``; a ``model:`` mapping of parts alone (keys that are
    no :class:`ModelConfig` field) names no model, so the family that composes such parts is chosen later; nor does
    one that loads ``hf:DIR`` without a ``name`` (DIR's config.json names it, :func:`_hf_load_defaults`)."""
    if cls is LoongForgeConfig and isinstance(data, dict):
        return _hf_load_defaults(_hub_ids_resolved(data))
    if cls in _NAME_SHORTHAND.values() and isinstance(data, str):
        return {"name": data}
    if cls is ModelConfig and isinstance(data, dict) and "name" not in data and (
        set(data) - set(MODEL_KEYS) or _loads_hf(data)
    ):
        return {"name": None, **data}
    for shorthand_cls, word, mapping in _WORD_SHORTHAND.values():
        if cls is shorthand_cls and data == word:
            return dict(mapping)
    return data


def _hub_ids_resolved(raw: dict[str, Any]) -> dict[str, Any]:
    """``model.load`` and ``data.tokenizer`` given as ``hf:OWNER/NAME[@REV]`` (a Hugging Face Hub id, not an existing
    path) rewritten to ``hf:`` + the local snapshot (:mod:`loongforge.hf_dirs`: downloaded into the Hugging Face
    cache, or found there offline), so that everything after reads a directory."""
    from loongforge.hf_dirs import looks_like_hub_id, resolve_hub_directory

    resolved = dict(raw)
    for section, key in (("model", "load"), ("data", "tokenizer")):
        block = resolved.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if isinstance(value, str) and value.startswith("hf:") and looks_like_hub_id(value[3:]):
            directory = resolve_hub_directory(value[3:], what=f"{section}.{key}")
            resolved[section] = {**block, key: f"hf:{directory}"}
    return resolved


def _loads_hf(model: dict[str, Any]) -> bool:
    return isinstance(model.get("load"), str) and model["load"].startswith("hf:")


def _hf_load_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """``model: {load: hf:DIR}`` with no ``name`` and no parts takes the whole model from DIR, its tokenizer too: a
    ``data.tokenizer`` the config leaves unset becomes ``hf:DIR`` when DIR holds ``tokenizer.json`` (else the default,
    ``byte``). A tokenizer the config names is kept, and checked against the vocabulary like any other."""
    model, data = raw.get("model"), raw.get("data")
    if not (isinstance(model, dict) and "name" not in model and _loads_hf(model) and not set(model) - set(MODEL_KEYS)):
        return raw
    if not (data is None or (isinstance(data, dict) and "tokenizer" not in data)):
        return raw
    from loongforge.hf_dirs import holds_hf_tokenizer

    if not holds_hf_tokenizer(Path(model["load"][3:]).expanduser()):
        return raw
    return {**raw, "data": {**(data or {}), "tokenizer": model["load"]}}
