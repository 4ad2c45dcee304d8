"""Entry point of the ``vlm`` plugin.

Planned components (the VLM issue fills them): Qwen2/2.5-VL and SigLIP vision encoders, MLP and
patch-merger projectors, composition with any registered LLM backbone, image-text datasets.
"""

from __future__ import annotations

#: Shown by ``loongforge plugins`` until the plugin registers components of its own.
SUMMARY = "vision-language models: encoders, projectors, any LLM backbone (components arrive in 0.2)"
