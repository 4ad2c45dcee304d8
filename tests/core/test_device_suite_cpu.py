"""The built-in CPU backend passes the conformance suite every device plugin runs."""

from __future__ import annotations

from loongforge.devices.cpu import CPUBackend
from loongforge.testing.device_suite import DeviceBackendSuite


class TestCPUBackendConformance(DeviceBackendSuite):
    backend_class = CPUBackend
    registry_name = "cpu"
