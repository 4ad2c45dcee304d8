"""Entry point: registers the ``olmo2`` flavors and the reader of ``Olmo2ForCausalLM`` directories.

Both hooks register plain objects (dataclass flavors, a reader), so ``loongforge plugins`` and ``loongforge list``
import no torch; megatron and the layer code load only when a run, ``generate`` or ``convert`` builds a model.
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "example model family: OLMo-2 with its own layer code, reading and writing Olmo2ForCausalLM directories"


@hookimpl
def loongforge_register_models(registry):
    from loongforge_example_family.flavors import FLAVORS, HF_IDS, describe

    for name, flavor in FLAVORS.items():
        registry.register(name, flavor, aliases=HF_IDS.get(name, ()), description=describe(flavor))


@hookimpl
def loongforge_register_hf_architectures(registry):
    from loongforge_example_family.flavors import ARCHITECTURE
    from loongforge_example_family.hf import MODEL_TYPE, Olmo2Reader

    registry.register(ARCHITECTURE, Olmo2Reader(), aliases=(MODEL_TYPE,), description="OLMo-2 (example family)")
