"""Gemma flavors: zero-centred RMSNorm (``1 + w``), GeGLU MLP, embeddings scaled by ``sqrt(hidden_size)``,
explicit ``head_dim``, multi-query attention at 2B, tied embeddings.

``gemma-2b`` copies https://huggingface.co/google/gemma-2b/blob/main/config.json (``hidden_size`` 2048, 18
layers, 8 heads, 1 key/value head, ``head_dim`` 256, ``intermediate_size`` 16384, ``vocab_size`` 256000,
8192 positions, ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000). ``gemma-tiny``'s heads (4 x 128) are wider
than its hidden size (256), so the explicit head_dim path is exercised.

Gemma-2 adds norms after attention and MLP, soft-caps attention scores (50) and output logits (30), and
alternates sliding-window (4096) and full attention layers. ``gemma2-2b`` copies
https://huggingface.co/google/gemma-2-2b/blob/main/config.json (``hidden_size`` 2304, 26 layers, 8 heads, 4
key/value heads, ``head_dim`` 256, ``intermediate_size`` 9216, ``query_pre_attn_scalar`` 256).
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_layouts import FAMILIES


def _gemma(hidden_size: int, **kw: object) -> DecoderFlavor:
    base = dict(family="gemma", activation="gelu_tanh", norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=8192, tie_word_embeddings=True, hf_architecture=FAMILIES["gemma"].architecture,
                embedding_multiplier=hidden_size**0.5, **FAMILIES["gemma"].switches)
    return DecoderFlavor(hidden_size=hidden_size, **{**base, **kw})  # type: ignore[arg-type]


def _gemma2(hidden_size: int, **kw: object) -> DecoderFlavor:
    base = dict(family="gemma2", hf_architecture=FAMILIES["gemma2"].architecture, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, sliding_window=4096, sliding_window_full_every=2,
                **FAMILIES["gemma2"].switches)
    return _gemma(hidden_size, **{**base, **kw})


FLAVORS: dict[str, DecoderFlavor] = {
    # head_dim 256 * 8 heads = hidden 2048, so it is implied (None), as flavors read from config.json have it.
    "gemma-2b": _gemma(2048, num_layers=18, ffn_hidden_size=16384, num_attention_heads=8, num_query_groups=1,
                       vocab_size=256000),
    "gemma-tiny": _gemma(256, num_layers=4, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=1,
                         head_dim=128, vocab_size=384),
    "gemma2-2b": _gemma2(2304, num_layers=26, ffn_hidden_size=9216, num_attention_heads=8, num_query_groups=4,
                         head_dim=256, query_pre_attn_scalar=256, vocab_size=256000),
    # A 64-token window, so the sliding layers differ from the full ones on the quickstart's sequences.
    "gemma2-tiny": _gemma2(256, num_layers=4, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                           head_dim=128, query_pre_attn_scalar=128, vocab_size=384, sliding_window=64),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {"gemma-2b": ("google/gemma-2b",), "gemma2-2b": ("google/gemma-2-2b",)}
