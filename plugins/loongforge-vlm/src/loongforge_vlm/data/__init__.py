"""Image-text data for VLM training: sources, the Qwen vision processor, vision tokens, checks and packed batches.

Importing this package is free (no numpy, PIL or torch): the names below load from their submodules on first
use, so plugin registration stays light. Modules:

- :mod:`~loongforge_vlm.data.processor`: images/videos -> Qwen ViT patch rows + ``grid_thw``, or fixed-size
  (SigLIP) pixels
- :mod:`~loongforge_vlm.data.tiling`: InternVL's dynamic tiling (tiles + thumbnail) for InternViT
- :mod:`~loongforge_vlm.data.anyres`: LLaVA-OneVision's AnyRes tiling (base tile + grid) for SigLIP towers
- :mod:`~loongforge_vlm.data.tokens`: vision tokens, ``VisionByteTokenizer``, conversation -> ids + reply mask
- :mod:`~loongforge_vlm.data.records` / :mod:`~loongforge_vlm.data.sources`: record formats; jsonl and tar shards
- :mod:`~loongforge_vlm.data.dataset` / :mod:`~loongforge_vlm.data.skips`: checked samples, counted skips
- :mod:`~loongforge_vlm.data.batching`: rows (packed or not) and the batch dict
- :mod:`~loongforge_vlm.data.kind`: the dataset kinds a config names; tokenizer/processor for a VLM flavor
- :mod:`~loongforge_vlm.data.shapes`: the synthetic shapes set (`loongforge make-data shapes`)
- :mod:`~loongforge_vlm.data.pairs`: image preference pairs (``training.phase: dpo``)
- :mod:`~loongforge_vlm.data.shape_pairs`: preference pairs on shapes images (`loongforge make-data shapes-pairs`)
"""

from __future__ import annotations

from loongforge.lazy import lazy_exports

_EXPORTS = {
    "ImageProcessor": "processor",
    "VisionProcessor": "processor",
    "FixedSizeProcessor": "processor",
    "processor_for": "processor",
    "TilingProcessor": "tiling",
    "AnyResProcessor": "anyres",
    "smart_resize": "processor",
    "VisionByteTokenizer": "tokens",
    "VisionTokenIds": "tokens",
    "vision_token_ids": "tokens",
    "tokenize_multimodal": "tokens",
    "parse_record": "records",
    "JsonlSource": "sources",
    "WebDatasetSource": "sources",
    "expand_pattern": "sources",
    "SkipReport": "skips",
    "VisionChatDataset": "dataset",
    "VisionSample": "dataset",
    "VisionRowDataset": "batching",
    "collate": "batching",
    "split_rows": "batching",
    "image_text_dataset": "kind",
    "shapes_dataset": "kind",
    "image_preference_dataset": "kind",
    "shapes_pairs_dataset": "kind",
    "VisionPairDataset": "pairs",
    "VisionPairRows": "pairs",
    "sources_for": "kind",
    "byte_tokenizer_for": "kind",
    "processor_for_vlm": "kind",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
