"""Entry point: registers the ``example-gpt`` flavors.

Flavors are plain dataclasses, so registering imports no torch: ``loongforge plugins`` and ``loongforge list``
stay instant. The megatron model is built only when a run (or ``generate`` / ``convert``) asks for one.
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "example model family: GPT-2-style decoders (LayerNorm, GELU, biases, learned positions) as table rows"


@hookimpl
def loongforge_register_models(registry):
    from loongforge_example_family.flavors import FLAVORS, describe

    for name, flavor in FLAVORS.items():
        registry.register(name, flavor, description=describe(flavor))
