"""Backend selection: explicit names must exist and be available; ``auto`` takes the highest priority."""

from __future__ import annotations

import pytest
from loongforge.devices.base import DeviceBackend
from loongforge.devices.selection import DeviceSelectionError, select_backend
from loongforge.registry import Registry


def _fake(name: str, priority: int, available: bool, why: str = "") -> type[DeviceBackend]:
    """A DeviceBackend subclass whose probe returns a fixed answer (FAKE: no hardware behind it)."""

    def probe(self):
        return available, why or f"{name} {'found' if available else 'missing'}"

    methods = {m: (lambda self, *a, **k: None) for m in (
        "set_device", "synchronize", "manual_seed", "set_rng_state")}
    methods.update(
        name=name, priority=priority, device_type=name, dist_backend="gloo", probe=probe,
        get_rng_state=lambda self: {}, memory_stats=lambda self: {"allocated": 0, "peak_allocated": 0},
        supports=lambda self, feature: False, spec_provider=lambda self: None,
    )
    return type(f"Fake{name.title()}Backend", (DeviceBackend,), methods)


def _registry(*backends: type[DeviceBackend]) -> Registry:
    registry = Registry("device")
    for cls in backends:
        registry.register(cls.name, cls, aliases=(f"{cls.name}-alias",))
    return registry


def test_auto_picks_highest_priority_available_backend():
    registry = _registry(_fake("cpu", 0, True), _fake("cuda", 200, True), _fake("xpu", 300, False))
    backend, reason = select_backend("auto", registry, source="config")
    assert backend.name == "cuda"
    assert "auto (config)" in reason and "priority (200)" in reason and "cpu (priority 0)" in reason


def test_auto_prefers_xpu_over_cuda_when_both_probe_true():
    # Kunlun's torch makes torch.cuda.is_available() true too; priority must decide.
    registry = _registry(_fake("cpu", 0, True), _fake("cuda", 200, True), _fake("xpu", 300, True))
    assert select_backend("auto", registry)[0].name == "xpu"


def test_auto_with_nothing_available_lists_every_probe():
    registry = _registry(_fake("cuda", 200, False, "no driver"))
    with pytest.raises(DeviceSelectionError, match=r"no backend is available.*cuda: unavailable \(no driver\)"):
        select_backend("auto", registry)


def test_explicit_name_and_alias_resolve():
    registry = _registry(_fake("cpu", 0, True), _fake("cuda", 200, True))
    backend, reason = select_backend("CPU", registry, source="LOONGFORGE_DEVICE")
    assert backend.name == "cpu" and reason.startswith("cpu requested by LOONGFORGE_DEVICE")
    assert select_backend("cuda-alias", registry, source="--device")[0].name == "cuda"


def test_explicit_unavailable_backend_is_an_error_not_a_fallback():
    registry = _registry(_fake("cpu", 0, True), _fake("cuda", 200, False, "no NVIDIA driver"))
    with pytest.raises(DeviceSelectionError) as err:
        select_backend("cuda", registry, source="--device")
    message = str(err.value)
    assert "device 'cuda' (--device) is not available: no NVIDIA driver" in message
    assert "Available: cpu." in message


def test_explicit_unknown_backend_lists_known_and_suggests():
    registry = _registry(_fake("cpu", 0, True))
    with pytest.raises(DeviceSelectionError) as err:
        select_backend("cpx", registry, source="config")
    message = str(err.value)
    assert "Unknown device 'cpx'" in message and "Known: cpu" in message
    assert "Did you mean 'cpu'?" in message and "(requested by config" in message


def test_registered_object_that_is_not_a_backend_is_rejected():
    registry = Registry("device")
    registry.register("weird", lambda: object())
    with pytest.raises(DeviceSelectionError, match="not a DeviceBackend"):
        select_backend("weird", registry)
