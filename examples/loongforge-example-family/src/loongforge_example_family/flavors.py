"""The ``example-gpt`` family: a GPT-2-style decoder written as data, with no model code of its own.

Every architectural choice is a :class:`~loongforge.models.DecoderFlavor` switch that core maps to
megatron-core's own ``TransformerConfig`` options, so core's builder builds it on any device backend (layers
from the device's spec provider), every parallel layout splits it, and ``loongforge generate`` and ``convert``
rebuild it through the same builder. What makes it a family of its own is its name and its optional Hugging
Face adapter below; a new decoder that megatron-core can express needs nothing more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loongforge.models import DecoderFlavor, DecoderHFAdapter

#: The switches that make a decoder GPT-2-shaped (https://huggingface.co/openai-community/gpt2/blob/main/config.json:
#: ``layer_norm_epsilon`` 1e-5, ``activation_function`` gelu_new = tanh-approximated GELU, biases on every linear,
#: learned absolute positions, output layer tied to the embedding).
GPT_SWITCHES = dict(normalization="LayerNorm", norm_eps=1e-5, activation="gelu_tanh", gated_linear_unit=False,
                    add_bias_linear=True, position_embedding="learned_absolute", tie_word_embeddings=True)


@dataclass(frozen=True)
class ExampleGPTFlavor(DecoderFlavor):
    """A GPT-2-style decoder of the ``example-gpt`` family.

    Only one slot of the model-family contract (:class:`loongforge.models.ModelFamily`) is overridden: the
    Hugging Face adapter. Our weights are laid out exactly as GPT-2's, so the family lends core's decoder
    adapter a GPT-2 view of itself; ``loongforge convert mcore-to-hf`` then writes a ``GPT2LMHeadModel``
    directory that transformers loads. A family with its own layout returns its own
    :class:`~loongforge.models.HFAdapter` here; one without a Hugging Face counterpart returns ``None``.
    """

    def hf_adapter(self) -> DecoderHFAdapter:
        return DecoderHFAdapter(dataclasses.replace(self, family="gpt2", hf_architecture="GPT2LMHeadModel"))


def _flavor(**sizes: int) -> ExampleGPTFlavor:
    return ExampleGPTFlavor(family="example-gpt", hf_architecture="GPT2LMHeadModel", **GPT_SWITCHES, **sizes)


#: The family's table: a CPU size that trains in seconds (4 heads, so it splits over 2 tensor-parallel ranks;
#: a 384-id vocabulary that holds the byte tokenizer's 259 ids) and GPT-2 small's published size.
FLAVORS: dict[str, ExampleGPTFlavor] = {
    "example-gpt-tiny": _flavor(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                num_query_groups=4, vocab_size=384, max_position_embeddings=128),
    "example-gpt-small": _flavor(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                                 num_query_groups=12, vocab_size=50257, max_position_embeddings=1024),
}


def describe(flavor: ExampleGPTFlavor) -> str:
    """One line for ``loongforge list models``."""
    return (f"example-gpt decoder (GPT-2 style: LayerNorm, GELU MLP, biases, learned positions), "
            f"{flavor.num_layers} layers, d{flavor.hidden_size}, {flavor.num_attention_heads} heads")
