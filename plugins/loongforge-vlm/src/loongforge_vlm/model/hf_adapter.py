"""The VLM family's side of core's Hugging Face crossing: a reader of Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and
MoE) / InternVL / LLaVA-OneVision ``config.json`` files and the adapter of their tensors
(:class:`loongforge.models.family.HFReader`,
:class:`loongforge.models.family.HFAdapter`).

Why registered with core: every command that reads a Hugging Face directory through core (``loongforge generate``,
``diff``, ``model.load: hf:``) finds its model by the architecture registry and fills it through the family's
adapter, so a VLM directory is read there exactly as ``loongforge convert`` reads it. Both directions are
:mod:`loongforge_vlm.model.hf_interop`'s mappings; file names are the ones ``save_pretrained`` writes
(:func:`~loongforge_vlm.model.hf_interop.saved_layout`; Qwen3-VL-MoE's expert tensors are read in either of the
orientations transformers reads, :func:`~loongforge_vlm.model.hf_interop.in_memory_layout`), and the tensors a
directory must hold are derived from the same mapping on shape-only (meta) tensors, so the check and the load cannot
disagree.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

#: ``architectures[0]`` -> (encoder family, ``model_type``) of the Qwen VLMs (torch-free here, so registering them
#: imports nothing heavy; :mod:`loongforge_vlm.model.hf_interop` maps their tensors).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2VLForConditionalGeneration": ("qwen2-vl", "qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2.5-vl", "qwen2_5_vl"),
    "Qwen3VLForConditionalGeneration": ("qwen3-vl", "qwen3_vl"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3-vl", "qwen3_vl_moe"),
}
#: InternVL's architecture and ``model_type`` (:mod:`loongforge_vlm.model.internvl_interop` maps its tensors).
INTERNVL_ARCHITECTURE, INTERNVL_MODEL_TYPE = "InternVLForConditionalGeneration", "internvl"
#: LLaVA-OneVision's (:mod:`loongforge_vlm.model.llava_onevision_interop`).
LLAVA_ONEVISION_ARCHITECTURE, LLAVA_ONEVISION_MODEL_TYPE = "LlavaOnevisionForConditionalGeneration", "llava_onevision"
#: The architectures of the LLaVA layout (:mod:`loongforge_vlm.model.llava_layout`) and their ``model_type``.
LLAVA_LAYOUTS: dict[str, str] = {INTERNVL_ARCHITECTURE: INTERNVL_MODEL_TYPE,
                                 LLAVA_ONEVISION_ARCHITECTURE: LLAVA_ONEVISION_MODEL_TYPE}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLMHFReader:
    """Reads a VLM ``config.json`` (transformers 5 nested or the published flat layout) into its flavor."""

    def read_config(self, raw: dict[str, Any], path: Path) -> Any:
        from loongforge_vlm.model.hf_interop import flavor_from_hf_config

        return flavor_from_hf_config(raw, where=str(path))


#: The one reader, registered by import path under every VLM architecture.
READER = VLMHFReader()


class VLMHFAdapter:
    """One VLM flavor's tensors and ``config.json``, both ways."""

    def __init__(self, flavor: Any) -> None:
        self.flavor = flavor

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        from loongforge_vlm.model.hf_interop import hf_config_dict

        return {**(base or {}), **hf_config_dict(self.flavor, _DTYPES.get(dtype, dtype))}

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        from loongforge_vlm.model.hf_interop import saved_layout, to_hf

        return saved_layout(to_hf(state, self.flavor), self.flavor)

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        """Ours from the stored tensors; the vocabulary is padded as the TP=1 model pads it (what a standalone
        model, the one core fills from a directory, holds)."""
        from loongforge_vlm.model.hf_interop import from_hf, in_memory_layout

        return from_hf(in_memory_layout(tensors, self.flavor), self.flavor)

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        """The stored tensors of this model: the mapping of our state dict built on the meta device, under the
        names transformers 5 uses in memory or those ``save_pretrained`` writes, whichever the directory holds."""
        import torch
        from loongforge.models.decoder_model import padded_vocab_size
        from loongforge.models.hf_adapter import hf_tensor_shapes, hf_to_megatron

        from loongforge_vlm.model.hf_interop import EXPERT_TENSORS, MOE_ARCHITECTURE, saved_layout, to_hf
        from loongforge_vlm.model.vlm import _vision_parts

        text = self.flavor.foundation
        with torch.device("meta"):
            encoder, projector = _vision_parts(self.flavor)
            language = {name: torch.empty(shape) for name, shape in hf_tensor_shapes(text).items()}
        state = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
        if projector is not None:
            state.update({f"projector.{k}": v for k, v in projector.state_dict().items()})
        megatron = hf_to_megatron(language, text, padded_vocab_size=padded_vocab_size(text.vocab_size))
        state.update({f"language_model.{k}": v for k, v in megatron.items()})
        in_memory = to_hf(state, self.flavor)
        saved, stored = saved_layout(in_memory, self.flavor), set(stored)
        names = saved if len(stored & set(saved)) >= len(stored & set(in_memory)) else in_memory
        shapes: dict[str, tuple[int, ...] | None] = {k: tuple(v.shape) for k, v in names.items()}
        if self.flavor.hf_architecture == MOE_ARCHITECTURE:  # two orientations: their shapes are checked on reading
            shapes.update({name: None for name in shapes if name.endswith(EXPERT_TENSORS)})
        if text.tie_word_embeddings:
            shapes.setdefault("lm_head.weight", None)  # transformers may store the tied output layer again
        return shapes


def register_hf_architectures(registry: Any) -> None:
    """Each VLM architecture the plugin converts, with its ``model_type`` as an alias."""
    rows = {**{arch: model_type for arch, (_, model_type) in ARCHITECTURES.items()}, **LLAVA_LAYOUTS}
    for architecture, model_type in rows.items():
        registry.register(architecture, "loongforge_vlm.model.hf_adapter:READER", aliases=(model_type,),
                          description="vision-language model (loongforge-vlm)")
