"""RoPE inverse frequencies for a flavor, following Hugging Face's ``modeling_rope_utils`` formulas.

Megatron's ``RotaryEmbedding`` only knows Llama-3 scaling with hard-coded ``low_freq_factor=1``,
``high_freq_factor=4`` and ``original_max_position_embeddings=8192``. Computing ``inv_freq`` here from the
flavor's own values (and assigning it to the built model) keeps every scaling variant exact and lets the
parity tests compare against transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """``inv_freq`` (``[head_dim // 2]``, fp32) for base ``theta`` and an optional HF ``rope_scaling`` dict."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                       int(scaling["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float, old_len: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short kept, a smooth blend in between."""
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
