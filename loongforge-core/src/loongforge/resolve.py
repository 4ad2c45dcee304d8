"""Resolve every component name a config uses, before anything heavy is imported.

Running this first means a misspelled name fails in a fraction of a second with the registry's one-line
message (known names, did-you-mean, install hint) rather than after torch and megatron have loaded.

Names resolve through :func:`config_registry`: a ``pkg.module:factory`` name imports its module -- executing its
code -- only when the config may do that (:attr:`LoongForgeConfig.code_trusted`): always for a config the user
passed, for a checkpoint's recorded config only with ``--trust-code``.
"""

from __future__ import annotations

import difflib
from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.config.sections import origin_of
from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily, check_family
from loongforge.models.hf_adopt import adopt_hf_model
from loongforge.plugins import get_host
from loongforge.registry import Registry


def config_registry(config: LoongForgeConfig, kind: str, host: Any = None) -> Registry:
    """The registry of ``kind`` that ``config``'s names resolve in: as registered when the config may import code,
    else its view that refuses ``pkg.module:attr`` names (:meth:`~loongforge.registry.Registry.without_imports`)."""
    registry = (host or get_host()).registry(kind)
    return registry if config.code_trusted else registry.without_imports()


def registered_family(config: LoongForgeConfig, host: Any = None) -> ModelFamily:
    """The model family ``config.model.name`` names, as registered (no parts or overrides applied yet).

    A ``pkg.module:factory`` name (the escape hatch for a model outside every registry) may point at a family or
    at a callable returning one; importing it executes the module, so a checkpoint's config needs ``--trust-code``
    for it (:func:`config_registry`). Anything else is a one-line :class:`ConfigError`: core only ever calls the
    slots of :class:`~loongforge.models.family.ModelFamily`.
    """
    adopt_hf_model(config)  # ``model.load: hf:DIR`` without a name: the model DIR's config.json describes
    registry = config_registry(config, "model", host)
    name, where = config.model.name, f"model.name in {origin_of(config.source, 'model.name')}"
    if not name:
        return _default_composition(registry, config)
    found = registry.load(name, where=where)
    if not isinstance(found, ModelFamily) and callable(found) and name not in registry:
        found = found()  # ``pkg.module:factory``
    return check_family(found, name, where)


def resolve_model_flavor(config: LoongForgeConfig, host: Any = None) -> ModelFamily:
    """The model ``config.model`` describes: the registered family, its parts (``model.parts``, roles from the
    family's ``part_roles``) replaced or composed, then ``model.overrides`` applied."""
    host = host or get_host()
    family = registered_family(config, host)
    parts = {role: value for role, value in config.model.parts.items() if value is not None}  # null: part unset
    if parts:
        _check_roles(family, parts, config)
        family = check_family(family.with_parts(parts, registry=config_registry(config, "model", host),
                                                where=config.source),
                              config.model.name or family.family_name, f"model parts in {config.source}")
    if family.engine == "megatron" and family.decoder is None:  # e.g. a bare composition named without its parts
        raise ConfigError(f"{config.source}: model '{config.model.name}' is composed from parts; set model."
                          f"{'/'.join(family.part_roles) or '<parts>'} (`loongforge list models`)")
    return family.with_overrides(**config.model.overrides) if config.model.overrides else family


def model_label(config: LoongForgeConfig, family: ModelFamily) -> str:
    """How messages name the model: ``model.name``, or ``<family> composed from parts`` for parts alone."""
    return config.model.name or f"{family.family_name} composed from parts"


def decoder_flavor(family: ModelFamily) -> Any:
    """The megatron decoder a model trains (:attr:`ModelFamily.decoder`): the family itself for LLMs, a composed
    model's language backbone; ``None`` for task-engine models."""
    return family.decoder


def _check_roles(family: ModelFamily, parts: dict[str, Any], config: LoongForgeConfig) -> None:
    """Each part's role must be one of the family's :attr:`~ModelFamily.part_roles` (did-you-mean if not)."""
    shown = config.model.name or family.family_name
    if not family.part_roles:
        raise ConfigError(f"{config.source}: model.{'/'.join(parts)} set, but model '{shown}' is not composed of "
                          "parts (`loongforge list models`)")
    for role in parts:
        if role not in family.part_roles:
            close = difflib.get_close_matches(role, family.part_roles, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{config.source}: model.{role}: model '{shown}' has no part '{role}'; its parts: "
                              f"{', '.join(family.part_roles)}.{hint}")


def _default_composition(registry: Any, config: LoongForgeConfig) -> ModelFamily:
    """The one registered family with ``default_composition`` whose ``part_roles`` cover the config's parts:
    what ``model: {<role>: ..., ...}`` without a ``name`` composes."""
    roles = {role for role, value in config.model.parts.items() if value is not None}
    if not roles:
        raise ConfigError(f"{config.source}: model.name is not set (`loongforge list models`)")
    composers = [(entry.name, obj) for entry in registry.entries()
                 if isinstance(obj := entry.load(), ModelFamily) and obj.default_composition]
    found = [(name, obj) for name, obj in composers if roles <= set(obj.part_roles)]
    given = "/".join(sorted(roles))
    if not found and len(composers) == 1:  # one composition installed: name the misspelt role (did-you-mean)
        _check_roles(composers[0][1], {role: config.model.parts[role] for role in sorted(roles)}, config)
    if not found:
        raise ConfigError(f"{config.source}: model.{given} set without model.name, and no installed model family "
                          "composes a model from these parts; set model.name (`loongforge list models`)")
    if len(found) > 1:
        raise ConfigError(f"{config.source}: model.{given} set without model.name, and several families compose "
                          f"such a model ({', '.join(name for name, _ in found)}); set model.name to one")
    return found[0][1]


def resolve_names(config: LoongForgeConfig, *, engine: str | None = None) -> list[str]:
    """Check each named component the run uses; return ``kind: name (from provider)`` lines for display.

    ``engine`` is the model's step engine when known: a ``task`` model reads no ``data.dataset`` /
    ``data.tokenizer`` and is laid out by a torch-native strategy, so those names are neither checked nor shown.
    """
    host = get_host()
    adopt_hf_model(config)
    checks = [("model", config.model.name, "model.name")] if config.model.name else []
    if engine != "task":
        checks += [
            ("strategy", config.parallel.strategy, "parallel.strategy"),
            ("dataset", config.data.dataset, "data.dataset"),
            ("tokenizer", config.data.tokenizer.split(":", 1)[0], "data.tokenizer"),
        ]
    if config.device != "auto":
        checks.insert(0, ("device", config.device, "device"))
    checks += [("optimization", name, f"optimizations.{name}") for name in config.optimizations]
    lines = []
    for kind, name, key in checks:
        registry = host.registry(kind)
        if ":" in name and name not in registry:
            lines.append(f"{kind}: {name} (import path)")
            continue
        entry = registry.entry(name, where=f"{key} in {origin_of(config.source, key)}")
        lines.append(f"{kind}: {entry.name} (from {entry.provider})")
    if not config.model.name:  # parts alone: the family that composes them
        lines.insert(0, f"model: {registered_family(config, host).family_name} (composed of parts)")
    lines += [f"model.{role}: {value if isinstance(value, str) else 'inline fields'}"
              for role, value in config.model.parts.items()]
    return lines
