"""GPT-NeoX (Pythia) flavors: parallel attention + MLP residual with two LayerNorms, RoPE on the first quarter
of each head, GELU MLP, biases everywhere, untied output layer (``embed_out``).

Real sizes copy https://huggingface.co/EleutherAI/pythia-70m/blob/main/config.json and
https://huggingface.co/EleutherAI/pythia-160m/blob/main/config.json (``rotary_pct`` 0.25, ``rotary_emb_base``
10000, ``layer_norm_eps`` 1e-5, ``use_parallel_residual`` true, ``vocab_size`` 50304, 2048 positions).
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_layouts import FAMILIES


def _neox(**kw: object) -> DecoderFlavor:
    base = dict(family="gpt-neox", activation="gelu", residual="parallel", rotary_percent=0.25, norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=2048, hf_architecture=FAMILIES["gpt-neox"].architecture,
                **FAMILIES["gpt-neox"].switches)
    return DecoderFlavor(**{**base, **kw})  # type: ignore[arg-type]


FLAVORS: dict[str, DecoderFlavor] = {
    "pythia-70m": _neox(num_layers=6, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8,
                        num_query_groups=8, vocab_size=50304),
    "pythia-160m": _neox(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                         num_query_groups=12, vocab_size=50304),
    "pythia-tiny": _neox(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                         num_query_groups=4, vocab_size=384),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {"pythia-70m": ("EleutherAI/pythia-70m",),
                                      "pythia-160m": ("EleutherAI/pythia-160m",)}
