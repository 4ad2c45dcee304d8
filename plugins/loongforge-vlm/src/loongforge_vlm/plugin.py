"""Entry point of the ``vlm`` plugin: registers the vision encoders (Qwen2-VL / Qwen2.5-VL ViTs, SigLIP).

Torch-free at import and while registering: flavors are plain dataclasses; the torch modules are built only
when a run asks for one. Still to come (see CHANGELOG.md): composition with any registered LLM backbone
(M-RoPE for the Qwen VLMs), the MLP projector, image-text datasets.
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "vision-language models: Qwen2/2.5-VL ViT and SigLIP encoders, patch-merger projector"


@hookimpl
def loongforge_register_models(registry):
    from loongforge_vlm.encoders import qwen_vit_flavors, siglip_flavors

    families = ((qwen_vit_flavors.FLAVORS, qwen_vit_flavors.describe),
                (siglip_flavors.SIGLIP_FLAVORS, siglip_flavors.describe))
    for flavors, describe in families:
        for name, flavor in flavors.items():
            registry.register(name, flavor, description=describe(flavor))
