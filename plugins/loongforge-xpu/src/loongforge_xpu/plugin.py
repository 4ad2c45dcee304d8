"""Entry point of the ``xpu`` plugin: registers the Kunlunxin P800 device backend.

Torch-free at import: the backend class is registered by import path and loaded only when probed or selected.
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_devices(registry):
    registry.register(
        "xpu",
        "loongforge_xpu.backend:XPUBackend",
        aliases=("kunlun", "kunlunxin", "p800"),
        description="Kunlunxin P800 via torch_xmlir (CUDA-compatible torch, BKCL); probed before cuda",
    )
