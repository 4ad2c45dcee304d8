"""Composed vision-language models: encoder + projector + any core LLM backbone.

Torch-free: the flavors are plain dataclasses; the modules live in :mod:`loongforge_vlm.model.vlm` (the model),
:mod:`loongforge_vlm.model.position_ids` (M-RoPE ids) and :mod:`loongforge_vlm.model.hf_interop` (transformers'
Qwen2-VL / Qwen2.5-VL checkpoints).
"""

from loongforge_vlm.model.flavors import FLAVORS, MlpProjectorFlavor, VLMFlavor, describe

__all__ = ["FLAVORS", "MlpProjectorFlavor", "VLMFlavor", "describe"]
