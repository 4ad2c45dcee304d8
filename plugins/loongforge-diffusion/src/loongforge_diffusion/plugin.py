"""Entry point of the ``diffusion`` plugin: registers the Wan video DiT flavors.

Torch-free at import and while registering: flavors are plain dataclasses; the torch model is built only when a
run asks for one (:func:`loongforge_diffusion.task.DiffusionTask.build_model`).
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_models(registry):
    from loongforge_diffusion.wan.flavors import FLAVORS, HF_IDS, describe

    for name, flavor in FLAVORS.items():
        registry.register(name, flavor, aliases=HF_IDS.get(name, ()), description=describe(flavor))
