"""transformers' own Qwen2-VL / Qwen2.5-VL as the reference implementation of the VLM flavors that have a Hugging Face
layout (``VLMFlavor.reference_implementation()``): ``loongforge diff CHECKPOINT HF_DIR --reference B`` runs the
directory (what ``convert mcore-to-hf`` writes, or a published one) in transformers' ``*VLForConditionalGeneration``
on the replayed batch -- random text with an image in each sequence -- and names the first module, of the vision
tower or of the language model, where ours computes differently.

Pairs: the vision tower's come from its conversion's name map (:func:`loongforge_vlm.encoders.qwen_vit_adapter
.name_map`) plus each block and the merger; the language model's are core's decoder pairs
(:func:`loongforge.models.decoder_reference.decoder_module_pairs`) under the VLM's prefixes. Parameters are renamed
by the conversion itself (:func:`loongforge_vlm.model.hf_interop.to_hf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.models.family import ModulePair, module_pairs_from_parameters

#: Where each half lives in transformers' in-memory model, and where it lives in ours.
VISUAL, LANGUAGE, OUR_ENCODER, OUR_LANGUAGE = "model.visual.", "model.language_model.", "encoder.", "language_model."


def vision_pairs(encoder: Any) -> tuple[ModulePair, ...]:
    """Our Qwen ViT's modules and transformers' vision tower's (both lay patches out as ``[patches, dim]``)."""
    from loongforge_vlm.encoders.qwen_vit_adapter import name_map

    renamed = module_pairs_from_parameters(name_map(encoder))
    whole = [ModulePair(f"blocks.{i}", f"blocks.{i}") for i in range(encoder.num_layers)]
    return tuple(ModulePair(OUR_ENCODER + p.ours, VISUAL + p.theirs) for p in (*renamed, *whole,
                                                                              ModulePair("merger", "merger")))


def language_pairs(foundation: Any) -> tuple[ModulePair, ...]:
    """Core's decoder pairs with the language model under the VLM's prefixes (``lm_head`` stays at the top)."""
    from loongforge.models.decoder_reference import decoder_module_pairs

    def theirs(name: str) -> str:
        return LANGUAGE + name.removeprefix("model.") if name.startswith("model.") else name

    return tuple(ModulePair(OUR_LANGUAGE + p.ours, theirs(p.theirs), p.seq_first, p.width)
                 for p in decoder_module_pairs(foundation))


@dataclass(frozen=True)
class TransformersVLM:
    """transformers' ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` of one flavor
    (:class:`~loongforge.models.family.ReferenceImplementation`)."""

    flavor: Any
    library: str = "transformers"

    def load(self, path: Path) -> Any:
        from loongforge.models.decoder_reference import load_transformers_model

        return load_transformers_model("AutoModelForImageTextToText", path)

    def avoided_tokens(self, path: Path) -> tuple[int, ...]:
        from loongforge.models.decoder_reference import padding_token

        return padding_token(path, section="text_config")

    def loss(self, model: Any, batch: Mapping[str, Any]) -> Any:
        """Mean next-token cross-entropy over every position, as our VLM's per-token loss is averaged; the M-RoPE
        positions are transformers' own, from the image tokens (``mm_token_type_ids``) and grids."""
        import torch.nn.functional as F

        tokens = batch["tokens"]
        types = (tokens == self.flavor.image_token_id).long()
        logits = model(input_ids=tokens, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                       mm_token_type_ids=types).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def module_pairs(self) -> tuple[ModulePair, ...]:
        """The vision tower's, then the language model's: the order the forward pass reaches them."""
        return (*vision_pairs(self.flavor.encoder), *language_pairs(self.flavor.foundation))

    def parameters(self, state: Mapping[str, Any]) -> dict[str, Any]:
        from loongforge_vlm.model.hf_interop import to_hf

        return to_hf(state, self.flavor)
