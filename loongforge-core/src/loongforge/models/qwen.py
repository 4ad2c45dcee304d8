"""Qwen2, Qwen2.5 and Qwen3 flavors and a tiny Qwen3 for CPU, with Hugging Face ids as aliases.

Qwen2/2.5 add a bias to the QKV projection; Qwen3 drops it, normalises queries and keys per head (QK-norm)
and sets ``head_dim`` independently of ``hidden_size / heads``. Real sizes copy the published base-model
``config.json`` hyperparameters.
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor

_QWEN_VOCAB = 151936


def _qwen2(**kw: object) -> DecoderFlavor:
    base = dict(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, add_qkv_bias=True,
                hf_architecture="Qwen2ForCausalLM")
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


def _qwen3(**kw: object) -> DecoderFlavor:
    base = dict(family="qwen3", vocab_size=_QWEN_VOCAB, max_position_embeddings=40960, rope_theta=1000000.0,
                norm_eps=1e-6, qk_layernorm=True, head_dim=128, hf_architecture="Qwen3ForCausalLM")
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


FLAVORS: dict[str, DecoderFlavor] = {
    "qwen2-0.5b": _qwen2(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=_QWEN_VOCAB, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "qwen2.5-0.5b": _qwen2(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                           num_query_groups=2, vocab_size=_QWEN_VOCAB, max_position_embeddings=32768,
                           tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                           num_query_groups=2, vocab_size=_QWEN_VOCAB, max_position_embeddings=131072,
                           tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                         num_query_groups=4, vocab_size=152064, max_position_embeddings=131072),
    "qwen3-0.6b": _qwen3(num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                         num_query_groups=8, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                         num_query_groups=8, tie_word_embeddings=True),
    "qwen3-4b": _qwen3(num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32,
                       num_query_groups=8, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                       num_query_groups=8),
    # head_dim 64 with 8 heads (512) != hidden 256, like the real Qwen3 sizes, so that path is exercised.
    "qwen3-tiny": _qwen3(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8,
                         num_query_groups=4, head_dim=64, vocab_size=384, max_position_embeddings=2048,
                         tie_word_embeddings=True),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {
    "qwen2-0.5b": ("Qwen/Qwen2-0.5B",),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B",),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B",),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B",),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B-Base"),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B-Base"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "Qwen/Qwen3-4B-Base"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"),
}
