"""Resolve every component name a config uses, before anything heavy is imported.

Running this first means a misspelled name fails in a fraction of a second with the registry's one-line
message (known names, did-you-mean, install hint) rather than after torch and megatron have loaded.
"""

from __future__ import annotations

from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.plugins import get_host


def resolve_model_flavor(config: LoongForgeConfig, host: Any = None) -> Any:
    """The flavor ``config.model`` names (registry name or ``pkg.module:factory``), with its overrides applied."""
    host = host or get_host()
    flavor = host.registry("model").load(config.model.name, where=f"model.name in {config.source}")
    if callable(flavor) and not hasattr(flavor, "with_overrides"):  # a ``pkg.module:factory`` escape hatch
        flavor = flavor()
    return flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor


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
