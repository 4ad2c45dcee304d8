"""Entry point of the ``cuda`` plugin: registers the NVIDIA GPU device backend.

Torch-free at import: the backend class is registered by import path and loaded only when selected.
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_devices(registry):
    registry.register(
        "cuda",
        "loongforge_cuda.backend:CUDABackend",
        aliases=("gpu", "nvidia"),
        description="NVIDIA GPUs: NCCL, Transformer Engine layers when installed, bf16/fp8 by capability",
    )
