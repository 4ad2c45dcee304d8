"""The ``olmo2`` family: OLMo-2's decoder, with layer code of its own (:mod:`loongforge_example_family.layers`).

An OLMo-2 layer is not one that core's ``DecoderFlavor`` switches describe: it has no norm *before* attention or
the MLP, normalises each sublayer's output before the residual add, and normalises the whole query and key
projections (all heads at once) before RoPE. So the flavor keeps the sizes and the switches OLMo-2 shares with
a Llama (RMSNorm, SwiGLU, RoPE, no biases) as data, and overrides three slots of the model-family contract
(:class:`loongforge.models.ModelFamily`):

* ``decoder_spec`` hands core's builder the family's own layer specs (a
  :class:`loongforge.models.chunks.DecoderSpec`); core keeps the embedding, output layer, vocabulary padding,
  RoPE and layout-independent initialisation;
* ``hf_adapter`` returns the family's own :class:`~loongforge_example_family.hf.Olmo2HFAdapter` (OLMo-2's tensor
  names and ``config.json``), which ``loongforge convert`` and ``model.load: hf:DIR`` use;
* ``num_params`` counts the whole-width QK-norm weights, which core's per-head count does not know.

Torch-free: registering and listing the flavors imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models import DecoderFlavor

ARCHITECTURE = "Olmo2ForCausalLM"

#: DecoderFlavor fields that the OLMo-2 layer fixes. The flavor's ``qk_layernorm`` / ``post_norms`` switches
#: select core's per-head QK-norm and Gemma-2's sandwich norms; OLMo-2's own norms are built by its layer, so
#: those switches stay off. Everything else (sizes, GQA, head_dim, RoPE theta, eps, tied embeddings) is free.
FIXED: dict[str, Any] = dict(
    normalization="RMSNorm", norm_zero_centered=False, activation="silu", gated_linear_unit=True,
    add_bias_linear=False, add_qkv_bias=False, position_embedding="rope", rotary_percent=1.0, rope_scaling=None,
    residual="sequential", qk_layernorm=False, post_norms=False, num_experts=None, output_layer_bias=False,
    embedding_multiplier=None, attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=None,
    query_pre_attn_scalar=None, mrope_section=None,
)


@dataclass(frozen=True)
class Olmo2Flavor(DecoderFlavor):
    """One OLMo-2 size: a :class:`DecoderFlavor` whose layers and Hugging Face layout are the family's own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, needed in FIXED.items():
            if getattr(self, name) != needed:
                raise ConfigError(f"{self.family} flavor: {name}={getattr(self, name)!r} is not part of the OLMo-2 "
                                  f"layer (needs {needed!r})")

    def decoder_spec(self) -> Any:
        """OLMo-2's layers, built from the device's spec provider into core's ``GPTModel`` chunk -- by this family,
        or by a composed model (a VLM) that takes it as its foundation."""
        from loongforge_example_family.layers import OLMO2_DECODER

        return OLMO2_DECODER

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Core's count of a Llama of these sizes (its two pre-norms per layer stand for OLMo-2's two post-norms)
        plus the QK-norm weights, one per query and key channel of every layer."""
        qk_norms = (self.num_attention_heads + self.num_query_groups) * self.kv_channels * self.num_layers
        return super().num_params(include_embeddings=include_embeddings) + qk_norms

    def hf_adapter(self) -> Any:
        """OLMo-2's ``Olmo2ForCausalLM`` tensors and ``config.json``, both ways."""
        from loongforge_example_family.hf import Olmo2HFAdapter

        return Olmo2HFAdapter(self)


def olmo2(**fields: Any) -> Olmo2Flavor:
    """An OLMo-2 flavor: ``fields`` (sizes, RoPE theta, eps) over the family's fixed switches."""
    return Olmo2Flavor(family="olmo2", hf_architecture=ARCHITECTURE, **{**FIXED, **fields})


#: The family's table. ``olmo2-tiny`` trains in seconds on a CPU (4 query heads in 2 groups, so it splits over 2
#: tensor-parallel ranks with grouped-query attention; 384 ids hold the byte tokenizer's 259). ``olmo2-1b`` is
#: https://huggingface.co/allenai/OLMo-2-0425-1B/blob/main/config.json: hidden_size 2048, intermediate_size 8192,
#: 16 layers, 16 heads and 16 key/value heads, vocab_size 100352, max_position_embeddings 4096, rope_theta 500000,
#: rms_norm_eps 1e-6, untied lm_head.
FLAVORS: dict[str, Olmo2Flavor] = {
    "olmo2-tiny": olmo2(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        vocab_size=384, max_position_embeddings=256, rope_theta=500000.0, norm_eps=1e-6),
    "olmo2-1b": olmo2(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                      num_query_groups=16, vocab_size=100352, max_position_embeddings=4096, rope_theta=500000.0,
                      norm_eps=1e-6),
}

#: Hugging Face repository ids accepted as model names.
HF_IDS: dict[str, tuple[str, ...]] = {"olmo2-1b": ("allenai/OLMo-2-0425-1B",)}


def describe(flavor: Olmo2Flavor) -> str:
    """One line for ``loongforge list models``."""
    return (f"olmo2 decoder (OLMo-2: post-norms, whole-width QK-norm, SwiGLU, RoPE), {flavor.num_layers} layers, "
            f"d{flavor.hidden_size}, {flavor.num_attention_heads}/{flavor.num_query_groups} heads")
