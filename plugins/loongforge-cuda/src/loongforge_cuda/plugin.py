"""Entry point of the ``cuda`` plugin: registers the NVIDIA GPU device backend, the ``adaptive-fp8`` optimization and
the ``loongforge fp8-measure`` command that writes its policy.

Torch-free at import: all are registered by import path and loaded only when selected.
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


@hookimpl
def loongforge_register_optimizations(registry):
    registry.register(
        "adaptive-fp8",
        "loongforge_cuda.fp8.optimization:AdaptiveFP8Optimization",
        description="FP8 per GEMM module only where a measured policy says it beats BF16 at the run's token count",
    )


@hookimpl
def loongforge_register_commands(commands):
    from loongforge_cuda.commands import register_commands

    register_commands(commands)
