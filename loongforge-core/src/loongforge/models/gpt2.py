"""GPT-2 flavors: LayerNorm with bias, learned absolute positions, GELU (tanh) MLP, biases everywhere, tied.

``gpt2`` copies https://huggingface.co/openai-community/gpt2/blob/main/config.json (``n_embd`` 768,
``n_layer`` 12, ``n_head`` 12, ``n_positions`` 1024, ``vocab_size`` 50257, ``layer_norm_epsilon`` 1e-5,
``activation_function`` gelu_new, ``n_inner`` null = 4 * 768); ``gpt2-tiny`` is a CPU size.
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_layouts import FAMILIES


def _gpt2(**kw: object) -> DecoderFlavor:
    base = dict(family="gpt2", activation="gelu_tanh", norm_eps=1e-5, tie_word_embeddings=True,
                hf_architecture=FAMILIES["gpt2"].architecture, **FAMILIES["gpt2"].switches)
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


FLAVORS: dict[str, DecoderFlavor] = {
    "gpt2": _gpt2(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                  num_query_groups=12, vocab_size=50257, max_position_embeddings=1024),
    "gpt2-tiny": _gpt2(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                       num_query_groups=4, vocab_size=384, max_position_embeddings=1024),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {"gpt2": ("openai-community/gpt2",)}
