"""Core's Hugging Face adapter for its decoder families: the :class:`~loongforge.models.family.HFAdapter` that
``DecoderFlavor.hf_adapter()`` returns.

It only binds one flavor to the functions that already do the work -- state-dict names both ways
(:mod:`loongforge.models.hf_adapter`) and ``config.json`` (:mod:`loongforge.models.hf_config`) -- so commands
that convert any family (``loongforge convert``, ``checkpoint.save_hf``, the ModelFamilySuite) call the same
three methods whatever the family, and a plugin family can hand back this adapter for a flavor of a family core
knows (a GPT-2-shaped plugin decoder: ``DecoderHFAdapter(dataclasses.replace(flavor, family="gpt2"))``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from loongforge.models.flavor import DecoderFlavor


@dataclass(frozen=True)
class DecoderHFAdapter:
    """``*ForCausalLM`` tensors and ``config.json`` of one decoder flavor (TP=PP=1 full state dicts)."""

    flavor: DecoderFlavor

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``config.json`` mapping in ``dtype`` (fp32/bf16/fp16), keeping ``base``'s other keys."""
        from loongforge.models.hf_config import hf_config_dict

        return hf_config_dict(self.flavor, dtype, base)

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face tensors (as ``save_pretrained`` writes them) from a full megatron state dict."""
        from loongforge.models.hf_adapter import megatron_to_hf

        return megatron_to_hf(state, self.flavor, per_expert=True)

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        """The full megatron state dict from Hugging Face tensors, vocabulary rows padded to ``padded_vocab_size``
        (default: as a TP=1 model holds them)."""
        from loongforge.models.decoder_model import padded_vocab_size as tp1_padded
        from loongforge.models.hf_adapter import hf_to_megatron

        rows = padded_vocab_size or tp1_padded(self.flavor.vocab_size)
        return hf_to_megatron(tensors, self.flavor, padded_vocab_size=rows)

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        """Every tensor of a checkpoint by stored name: experts one module each unless the files fuse them,
        names without the base-model prefix where the files omit it (GPT-2), a tied ``lm_head.weight`` ignored."""
        from loongforge.models.hf_adapter import hf_tensor_shapes
        from loongforge.models.hf_layouts import with_base_prefix

        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in stored)
        expected = hf_tensor_shapes(self.flavor, per_expert=self.flavor.is_moe and not fused)
        stored_as = with_base_prefix(list(stored), self.flavor.family)  # canonical -> stored
        shapes: dict[str, tuple[int, ...] | None] = {stored_as.get(n, n): shape for n, shape in expected.items()}
        if self.flavor.tie_word_embeddings:  # older save_pretrained wrote it; the model reads the embedding
            shapes.setdefault(stored_as.get("lm_head.weight", "lm_head.weight"), None)
        return shapes
