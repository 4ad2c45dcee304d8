"""Llama flavors (Llama 2, Llama 3, 3.1, 3.2) and tiny CPU flavors, with Hugging Face ids as aliases.

Real sizes copy the published ``config.json`` hyperparameters; the tiny flavors are sized to train in
seconds on two CPU cores (vocab 384 covers the 259-token byte tokenizer; megatron pads it further).
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor

_LLAMA3_ROPE_8 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_32 = {**_LLAMA3_ROPE_8, "factor": 32.0}

FLAVORS: dict[str, DecoderFlavor] = {
    "llama2-7b": DecoderFlavor(
        family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0, norm_eps=1e-5,
    ),
    "llama2-13b": DecoderFlavor(
        family="llama", num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
        num_query_groups=40, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0, norm_eps=1e-5,
    ),
    "llama3-8b": DecoderFlavor(
        family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, norm_eps=1e-5,
    ),
    "llama3.1-8b": DecoderFlavor(
        family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_8, norm_eps=1e-5,
    ),
    "llama3-70b": DecoderFlavor(
        family="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, norm_eps=1e-5,
    ),
    "llama3.2-1b": DecoderFlavor(
        family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_32, norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama3.2-3b": DecoderFlavor(
        family="llama", num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
        num_query_groups=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_32, norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama-tiny": DecoderFlavor(
        family="llama", num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=4,
        num_query_groups=2, vocab_size=384, max_position_embeddings=2048, rope_theta=10000.0, norm_eps=1e-5,
    ),
    # Llama 3 shape at CPU size: GQA, rope_theta 500000 and llama3 RoPE scaling with a short original context,
    # so the scaling changes most frequencies over a tiny run's sequences.
    "llama3-tiny": DecoderFlavor(
        family="llama", num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8,
        num_query_groups=2, vocab_size=384, max_position_embeddings=2048, rope_theta=500000.0, norm_eps=1e-5,
        rope_scaling={**_LLAMA3_ROPE_8, "original_max_position_embeddings": 256}, tie_word_embeddings=True,
    ),
    "llama-debug": DecoderFlavor(
        family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
        num_query_groups=2, vocab_size=384, max_position_embeddings=1024, rope_theta=10000.0, norm_eps=1e-5,
    ),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {
    "llama2-7b": ("meta-llama/Llama-2-7b-hf",),
    "llama2-13b": ("meta-llama/Llama-2-13b-hf",),
    "llama3-8b": ("meta-llama/Meta-Llama-3-8B",),
    "llama3-70b": ("meta-llama/Meta-Llama-3-70B",),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B"),
    "llama3.2-1b": ("meta-llama/Llama-3.2-1B",),
    "llama3.2-3b": ("meta-llama/Llama-3.2-3B",),
}
