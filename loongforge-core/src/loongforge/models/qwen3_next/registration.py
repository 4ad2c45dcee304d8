"""What core's hooks call to register the Qwen3-Next family (torch-free, so ``loongforge list`` stays instant):
its flavors under their names (Hugging Face ids as aliases) and its ``config.json`` readers under their
architectures (``model_type`` as aliases)."""

from __future__ import annotations

from typing import Any


def register_models(registry: Any) -> None:
    """``loongforge_register_models``: every flavor of :data:`loongforge.models.qwen3_next.flavors.FLAVORS`."""
    from loongforge.models.qwen3_next.flavors import FLAVORS, HF_IDS, describe

    for name, flavor in FLAVORS.items():
        registry.register(name, flavor, aliases=HF_IDS.get(name, ()), description=describe(flavor))


def register_hf_architectures(registry: Any) -> None:
    """``loongforge_register_hf_architectures``: ``Qwen3NextForCausalLM`` and the Qwen3.5 text models."""
    from loongforge.models.qwen3_next.hf import register_hf_architectures as register

    register(registry)
