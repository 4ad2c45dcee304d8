"""LoongForge's own components, registered through the same hooks as any external plugin.

This module is the ``core`` entry point of the ``loongforge`` group. It must stay torch-free: it only
records names and import paths; the targets are imported when a run uses them.
"""

from __future__ import annotations

from loongforge.plugins import hookimpl

SUMMARY = "LoongForge core: CPU backend, Llama/Qwen families on megatron-core, token datasets"


@hookimpl
def loongforge_register_devices(registry):
    registry.register(
        "cpu",
        "loongforge.devices.cpu:CPUBackend",
        aliases=("host",),
        description="Built-in CPU backend (gloo); patches megatron-core to run without CUDA",
    )


@hookimpl
def loongforge_register_models(registry):
    from loongforge.models.registration import register_builtin_models

    register_builtin_models(registry)


@hookimpl
def loongforge_register_parallel_strategies(registry):
    registry.register(
        "megatron",
        "loongforge.parallel.megatron:MegatronStrategy",
        aliases=("mcore",),
        description="megatron-core tensor/pipeline/data parallelism with sequence parallel and distributed optimizer",
    )


@hookimpl
def loongforge_register_datasets(registry):
    from loongforge.data.registration import register_builtin_datasets

    register_builtin_datasets(registry)


@hookimpl
def loongforge_register_tokenizers(registry):
    from loongforge.data.registration import register_builtin_tokenizers

    register_builtin_tokenizers(registry)
