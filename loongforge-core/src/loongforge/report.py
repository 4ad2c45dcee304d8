"""Human-readable reports for ``loongforge plugins``, ``list`` and ``doctor``.

Every cell is plugin or user text (descriptions such as "needs the [hf] extra", pip lines such as
``pkg[te]``), never markup, so each goes through :func:`rich.markup.escape` (:func:`_add_row`) -- rich would
otherwise take ``[hf]`` for a style tag and print nothing in its place.

``doctor`` reports what matters on this machine: versions, every device backend's probe (available or not, and
for an unavailable one why and what to do -- the backend's own words), and the vendor-stack section
(``doctor_rows``) of the backends that are available. An absent accelerator's section -- a dozen rows of an
environment nobody will train in here -- is shown only with ``--all``.
"""

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

#: Distributions whose versions every report shows (each device plugin reports its own stack in its section).
_CORE_STACK = ("loongforge-core", "torch", "megatron-core", "transformers")


def _console() -> Console:
    # Wide enough that names are never folded when output goes to a pipe or a test.
    return Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)


def _add_row(table: Table, *cells: str) -> None:
    """A row of plain text: markup characters in the cells are printed as they are."""
    table.add_row(*(escape(cell) for cell in cells))


def plugins_table(plugins: Iterable[PluginInfo]) -> None:
    table = Table(title="LoongForge plugins", title_justify="left")
    for column in ("plugin", "distribution", "version", "provides"):
        table.add_column(column, overflow="fold")
    for info in plugins:
        provides = "; ".join(f"{plural(kind)}: {', '.join(names)}" for kind, names in info.registered.items())
        _add_row(table, info.name, info.distribution, info.version, provides or info.summary or "(nothing registered)")
    _console().print(table)


def registry_table(registry: Registry) -> None:
    table = Table(title=f"Registered {plural(registry.kind)}", title_justify="left")
    for column in ("name", "aliases", "provided by", "description"):
        table.add_column(column, overflow="fold")
    for entry in registry.entries():
        _add_row(table, entry.label or entry.name, ", ".join(entry.aliases), entry.provider, entry.description)
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
        rows = [("error", f"{type(exc).__name__}: {exc} (a bug in {entry.provider}: please report it)")]
    if not rows:
        return
    table = Table(title=f"{entry.name} backend ({entry.provider})", title_justify="left")
    table.add_column("item")
    table.add_column("value", overflow="fold")
    for item, value in rows:
        _add_row(table, item, value)
    console.print(table)


def doctor(*, show_all: bool = False) -> None:
    """Versions, device backends (probed, never initialised), plugins and relevant environment; the sections of
    unavailable backends only with ``show_all``."""
    console = _console()
    env = Table(title="Environment", title_justify="left")
    env.add_column("item")
    env.add_column("value", overflow="fold")
    _add_row(env, "python", f"{platform.python_version()} ({sys.executable})")
    _add_row(env, "platform", platform.platform())
    for dist in _CORE_STACK:
        _add_row(env, dist, _version(dist))
    _add_row(env, "cpu cores", str(os.cpu_count()))
    for var in ("LOONGFORGE_DEVICE", "LOONGFORGE_DISABLE_PLUGINS", "LOONGFORGE_LOAD_PLUGINS"):
        _add_row(env, var, os.environ.get(var, "(unset)"))
    console.print(env)

    devices = Table(title="Device backends", title_justify="left")
    for column in ("backend", "provided by", "priority", "available", "why"):
        devices.add_column(column, overflow="fold")
    sections, hidden = [], []
    for entry in get_host().registry("device").entries():
        try:
            backend = entry.load()()
            ok, reason = backend.probe()
        except Exception as exc:  # noqa: BLE001 - doctor reports, it does not stop at the first problem
            _add_row(devices, entry.name, entry.provider, "?", "error",
                     f"{type(exc).__name__}: {exc} (a bug in {entry.provider}: please report it)")
            continue
        _add_row(devices, entry.name, entry.provider, str(backend.priority), "yes" if ok else "no", reason)
        if ok or show_all:
            sections.append((entry, backend))
        else:
            hidden.append(entry.name)
    console.print(devices)
    for entry, backend in sections:
        _backend_section(console, entry, backend)
    if hidden:
        console.print(escape(f"Not shown: the sections of the unavailable backends ({', '.join(hidden)}); "
                             "`loongforge doctor --all` prints them."))

    from loongforge.plugins import iter_plugins

    plugins_table(list(iter_plugins()))
    counts = ", ".join(f"{len(get_host().registry(kind).names())} {plural(kind)}" for kind in REGISTRY_KINDS)
    console.print(f"Registered: {counts}")
