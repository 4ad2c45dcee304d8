"""Resolve every component name a config uses, before anything heavy is imported.

Running this first means a misspelled name fails in a fraction of a second with the registry's one-line
message (known names, did-you-mean, install hint) rather than after torch and megatron have loaded.
"""

from __future__ import annotations

from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.plugins import get_host


def resolve_model_flavor(config: LoongForgeConfig, host: Any = None) -> Any:
    """The flavor ``config.model`` names (registry name or ``pkg.module:factory``), with its parts (composed
    models: ``model.encoder/projector/foundation``) and then its overrides applied."""
    host = host or get_host()
    registry = host.registry("model")
    flavor = registry.load(config.model.name, where=f"model.name in {config.source}")
    if callable(flavor) and not hasattr(flavor, "with_overrides"):  # a ``pkg.module:factory`` escape hatch
        flavor = flavor()
    parts = config.model.parts
    if parts:
        with_parts = getattr(flavor, "with_parts", None)
        if with_parts is None:
            raise ConfigError(f"{config.source}: model.{'/'.join(parts)} set, but model '{config.model.name}' is not "
                              "composed of parts (vision-language models are; `loongforge list models`)")
        flavor = with_parts(parts, registry=registry, where=config.source)
    return flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor


def decoder_flavor(flavor: Any) -> Any:
    """The megatron decoder inside a model flavor: the flavor itself for LLMs, the ``foundation`` (LLM backbone)
    of a composed model that wraps one (``compose``)."""
    return flavor.foundation if hasattr(flavor, "compose") else flavor


def resolve_names(config: LoongForgeConfig) -> list[str]:
    """Check each named component; return ``kind: name -> provider`` lines for display."""
    host = get_host()
    where = config.source
    lines = []
    checks = [
        ("model", config.model.name, f"model.name in {where}"),
        ("strategy", config.parallel.strategy, f"parallel.strategy in {where}"),
        ("dataset", config.data.dataset, f"data.dataset in {where}"),
        ("tokenizer", config.data.tokenizer.split(":", 1)[0], f"data.tokenizer in {where}"),
    ]
    if config.device != "auto":
        checks.insert(0, ("device", config.device, f"device in {where}"))
    checks += [("optimization", name, f"optimizations.{name} in {where}") for name in config.optimizations]
    for kind, name, location in checks:
        registry = host.registry(kind)
        if ":" in name and name not in registry:
            lines.append(f"{kind}: {name} (import path)")
            continue
        entry = registry.entry(name, where=location)
        lines.append(f"{kind}: {entry.name} (from {entry.provider})")
    return lines
