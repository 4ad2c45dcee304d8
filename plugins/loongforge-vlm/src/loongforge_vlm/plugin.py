"""Entry point of the ``vlm`` plugin: registers the vision encoders (Qwen2-VL / Qwen2.5-VL / Qwen3-VL ViTs, SigLIP) and
the composed vision-language models (encoder + projector + any core LLM backbone).

Torch-free at import and while registering: flavors are plain dataclasses; the torch modules are built only
when a run asks for one.
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "vision-language models: Qwen2/2.5/3-VL and SigLIP encoders, projectors, composed VLMs on any LLM"


@hookimpl
def loongforge_register_models(registry):
    from loongforge_vlm.encoders import internvit_flavors, qwen_vit_flavors, siglip_flavors
    from loongforge_vlm.model import flavors as vlm_flavors
    from loongforge_vlm.model.parts import VLMComposer, describe_composer

    families = ((qwen_vit_flavors.FLAVORS, qwen_vit_flavors.describe),
                (siglip_flavors.SIGLIP_FLAVORS, siglip_flavors.describe),
                (internvit_flavors.INTERNVIT_FLAVORS, internvit_flavors.describe))
    for flavors, describe in families:
        for name, flavor in flavors.items():
            registry.register(name, flavor, description=describe(flavor))
    registry.register("vlm", VLMComposer(), description=describe_composer(VLMComposer()))
    for name, flavor in vlm_flavors.FLAVORS.items():
        aliases = vlm_flavors.HF_IDS.get(name, ())
        registry.register(name, flavor, aliases=aliases, description=vlm_flavors.describe(flavor))


@hookimpl
def loongforge_register_datasets(registry):
    registry.register("image-text", "loongforge_vlm.data.kind:image_text_dataset", aliases=("vlm-chat",),
                      description="image-text conversations: jsonl + image files, or WebDataset .tar shards")
    registry.register("energon", "loongforge_vlm.data.kind:energon_dataset",
                      description="Megatron-Energon VQA/captioning/video-QA WebDataset directories (energon prepare)")
    registry.register("vlm-shapes", "loongforge_vlm.data.kind:shapes_dataset",
                      description="synthetic shapes VQA (colour/shape/count), generated on first use, no downloads")
    registry.register("image-preference", "loongforge_vlm.data.kind:image_preference_dataset",
                      description="image preference pairs for dpo: jsonl/shards of {image, prompt, chosen, rejected}")
    registry.register("vlm-shapes-pairs", "loongforge_vlm.data.kind:shapes_pairs_dataset",
                      description="shapes questions with a right (chosen) and a wrong answer, for dpo; generated "
                                  "on first use")


@hookimpl
def loongforge_register_hf_architectures(registry):
    from loongforge_vlm.model.hf_adapter import register_hf_architectures

    register_hf_architectures(registry)


@hookimpl
def loongforge_register_tokenizers(registry):
    registry.register("byte-vision", "loongforge_vlm.data.tokens:VisionByteTokenizer",
                      description="byte tokenizer + vision tokens (image pad 259, start 260, end 261, video pad 262)")


@hookimpl
def loongforge_register_commands(commands):
    from loongforge_vlm.commands import register_commands

    register_commands(commands)


@hookimpl
def loongforge_register_certification_recipes(registry):
    registry.register("vlm", "loongforge_vlm.certification:VLM",
                      description="vision-language model (siglip-tiny + mlp + qwen3-tiny)")
