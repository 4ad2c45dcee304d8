"""Entry point: registers the ``cpu-deterministic`` device backend.

Registration is by import path, so ``loongforge plugins`` and ``loongforge list devices`` never import torch
or the vendor runtime; the class is imported only when a run probes or selects it.
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_devices(registry):
    registry.register(
        "cpu-deterministic",
        "loongforge_example_device.backend:DeterministicCPUBackend",
        aliases=("cpu-det",),
        description="Example vendor backend: CPU with deterministic torch algorithms (copy me for a new device)",
    )
