"""Phi-2 flavors: attention and MLP in parallel from one shared LayerNorm, RoPE on 40% of each head, GELU
(tanh) MLP, biases everywhere including the LM head, untied.

``phi-2`` copies https://huggingface.co/microsoft/phi-2/blob/main/config.json (``hidden_size`` 2560, 32 layers
and heads, ``intermediate_size`` 10240, ``partial_rotary_factor`` 0.4, ``rope_theta`` 10000,
``layer_norm_eps`` 1e-5, ``vocab_size`` 51200, 2048 positions). ``phi-tiny`` has 8 heads of 32 so that 40%
of a head (12 dimensions) is even, as RoPE needs.
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_layouts import FAMILIES


def _phi(**kw: object) -> DecoderFlavor:
    base = dict(family="phi", activation="gelu_tanh", rotary_percent=0.4, norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=2048, hf_architecture=FAMILIES["phi"].architecture, **FAMILIES["phi"].switches)
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


FLAVORS: dict[str, DecoderFlavor] = {
    "phi-2": _phi(num_layers=32, hidden_size=2560, ffn_hidden_size=10240, num_attention_heads=32,
                  num_query_groups=32, vocab_size=51200),
    "phi-tiny": _phi(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                     num_query_groups=8, vocab_size=384),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {"phi-2": ("microsoft/phi-2",)}
