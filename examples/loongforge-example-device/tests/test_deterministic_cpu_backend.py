"""The example backend passes LoongForge's device conformance suite -- the test every vendor copies."""

from __future__ import annotations

from loongforge.testing.device_suite import DeviceBackendSuite
from loongforge_example_device.backend import DeterministicCPUBackend


class TestDeterministicCPUBackend(DeviceBackendSuite):
    backend_class = DeterministicCPUBackend
    registry_name = "cpu-deterministic"


def test_discovered_with_version():
    import loongforge_example_device
    from loongforge.testing.discovery import assert_discovered

    assert_discovered("example-device", "loongforge-example-device", loongforge_example_device.__version__)
