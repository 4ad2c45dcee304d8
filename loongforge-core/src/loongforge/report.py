"""Human-readable reports for ``loongforge plugins``, ``list`` and ``doctor``."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterable

from importlib_metadata import PackageNotFoundError, version
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from loongforge.devices.base import DeviceBackend
from loongforge.plugins import PluginInfo, get_host
from loongforge.registry import REGISTRY_KINDS, Entry, Registry, plural


def _console() -> Console:
    # Wide enough that names are never folded when output goes to a pipe or a test.
    return Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)


def plugins_table(plugins: Iterable[PluginInfo]) -> None:
    table = Table(title="LoongForge plugins", title_justify="left")
    for column in ("plugin", "distribution", "version", "provides"):
        table.add_column(column, overflow="fold")
    for info in plugins:
        provides = "; ".join(f"{plural(kind)}: {', '.join(names)}" for kind, names in info.registered.items())
        table.add_row(info.name, info.distribution, info.version, provides or info.summary or "(nothing registered)")
    _console().print(table)


def registry_table(registry: Registry) -> None:
    table = Table(title=f"Registered {plural(registry.kind)}", title_justify="left")
    for column in ("name", "aliases", "provided by", "description"):
        table.add_column(column, overflow="fold")
    for entry in registry.entries():
        table.add_row(entry.name, ", ".join(entry.aliases), entry.provider, entry.description)
    _console().print(table)


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _backend_section(console: Console, entry: Entry, backend: DeviceBackend) -> None:
    """The backend's own ``doctor_rows()`` (its vendor stack) as a table, when it has any."""
    try:
        rows = backend.doctor_rows()
    except Exception as exc:  # noqa: BLE001 - a broken section must not hide the rest of the report
        rows = [("error", f"{type(exc).__name__}: {exc}")]
    if not rows:
        return
    table = Table(title=f"{entry.name} backend ({entry.provider})", title_justify="left")
    table.add_column("item")
    table.add_column("value", overflow="fold")
    for item, value in rows:
        table.add_row(escape(item), escape(value))  # values hold pip extras like 'pkg[te]', not markup
    console.print(table)


def doctor() -> None:
    """Versions, device backends (probed, never initialised), plugins and relevant environment."""
    console = _console()
    env = Table(title="Environment", title_justify="left")
    env.add_column("item")
    env.add_column("value", overflow="fold")
    env.add_row("python", f"{platform.python_version()} ({sys.executable})")
    env.add_row("platform", platform.platform())
    for dist in ("loongforge-core", "torch", "megatron-core", "transformer-engine", "flash-attn", "transformers"):
        env.add_row(dist, _version(dist))
    env.add_row("cpu cores", str(os.cpu_count()))
    for var in ("LOONGFORGE_DEVICE", "LOONGFORGE_DISABLE_PLUGINS", "LOONGFORGE_LOAD_PLUGINS"):
        env.add_row(var, os.environ.get(var, "(unset)"))
    console.print(env)

    devices = Table(title="Device backends", title_justify="left")
    for column in ("backend", "provided by", "priority", "available", "why"):
        devices.add_column(column, overflow="fold")
    sections = []
    for entry in get_host().registry("device").entries():
        try:
            backend = entry.load()()
            ok, reason = backend.probe()
            devices.add_row(entry.name, entry.provider, str(backend.priority), "yes" if ok else "no", reason)
            sections.append((entry, backend))
        except Exception as exc:  # noqa: BLE001 - doctor reports, it does not stop at the first problem
            devices.add_row(entry.name, entry.provider, "?", "error", f"{type(exc).__name__}: {exc}")
    console.print(devices)
    for entry, backend in sections:
        _backend_section(console, entry, backend)

    from loongforge.plugins import iter_plugins

    plugins_table(list(iter_plugins()))
    counts = ", ".join(f"{len(get_host().registry(kind).names())} {plural(kind)}" for kind in REGISTRY_KINDS)
    console.print(f"Registered: {counts}")
