"""Choosing the device backend for a run.

Precedence (resolved by the caller): CLI flag > env ``LOONGFORGE_DEVICE`` > config ``device:`` > ``auto``.
An explicit name must be registered and available -- silently falling back to CPU when a user asked for CUDA
would waste a cluster allocation. ``auto`` picks the highest-priority available backend. Either way the
reason is returned so the trainer can log it and store it in checkpoint metadata.

Pure function over a registry (``.names()``, ``.load(name)``), so tests use fake backends.
"""

from __future__ import annotations

from typing import Any

from loongforge.devices.base import DeviceBackend
from loongforge.errors import LoongForgeError


class DeviceSelectionError(LoongForgeError):
    """The requested device backend is unknown or not usable on this machine."""


def _instantiate(target: Any, name: str) -> DeviceBackend:
    backend = target() if callable(target) else target
    if not isinstance(backend, DeviceBackend):
        raise DeviceSelectionError(
            f"device '{name}' is registered as {target!r}, which is not a DeviceBackend subclass or factory"
        )
    return backend


def _probe_all(registry: Any) -> list[tuple[DeviceBackend, bool, str]]:
    results = []
    for name in registry.names():
        backend = _instantiate(registry.load(name), name)
        available, why = backend.probe()
        results.append((backend, available, why))
    return results


def select_backend(requested: str, registry: Any, *, source: str = "config") -> tuple[DeviceBackend, str]:
    """Return ``(backend, reason)`` for ``requested`` (a backend name or ``"auto"``).

    ``source`` says where the request came from (``"--device"``, ``"LOONGFORGE_DEVICE"``, ``"config"``) and
    appears in the reason and in errors. Raises :class:`DeviceSelectionError` when an explicit name is
    unknown or unavailable, or when ``auto`` finds nothing available; messages list the known backends and
    why each is or is not available.
    """
    name = (requested or "auto").strip()
    if ":" not in name:  # a registered name (case-insensitive); an import path keeps Python's case
        name = name.lower()
    if name == "auto":
        probed = _probe_all(registry)
        available = [(b, why) for b, ok, why in probed if ok]
        if not available:
            raise DeviceSelectionError(f"device 'auto' ({source}): no backend is available. {_summary(probed)}")
        backend, why = max(available, key=lambda item: item[0].priority)
        others = ", ".join(f"{b.name} (priority {b.priority})" for b, _ in available if b is not backend)
        reason = f"auto ({source}): {backend.name} has the highest priority ({backend.priority}) of the available"
        reason += f" backends; {why}" + (f"; also available: {others}" if others else "")
        return backend, reason
    try:
        target = registry.load(name)
    except (LookupError, LoongForgeError) as exc:  # the registry's unknown-name error is both
        if isinstance(exc, LoongForgeError):  # already names the known backends, a did-you-mean, a pip line
            detail = str(exc)
        else:
            detail = f"Unknown device '{requested}'. Known: {', '.join(registry.names()) or '(none)'}."
        raise DeviceSelectionError(f"{detail} (requested by {source}; use 'auto' to pick one)") from None
    backend = _instantiate(target, name)
    available, why = backend.probe()
    if not available:
        probed = _probe_all(registry)
        usable = [b.name for b, ok, _ in probed if ok]
        raise DeviceSelectionError(
            f"device '{name}' ({source}) is not available: {why}. "
            f"Available: {', '.join(usable) or '(none)'}. {_summary(probed)}"
        )
    return backend, f"{name} requested by {source}; {why}"


def _summary(probed: list[tuple[DeviceBackend, bool, str]]) -> str:
    parts = [f"{b.name}: {'available' if ok else 'unavailable'} ({why})" for b, ok, why in probed]
    return "Backends: " + "; ".join(parts) + "." if parts else "No device backends are registered."
