"""Attention restricted to independent segments of one packed sequence (images, frames, windows).

Tokens attend only inside their segment. The segments are padded to one length and run as a batch through a
single ``scaled_dot_product_attention`` call with the padded keys masked, instead of one call per segment:
Qwen2.5-VL has hundreds of windows per image, and one batched call keeps the kernel count constant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_vlm.encoders.qwen_vit_layout import Segments


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Bidirectional attention of ``(tokens, heads, head_dim)`` inputs within ``segments``; same shape out."""
    if segments.valid.shape[0] == 1:
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)))
        return out[0].transpose(0, 1)
    batched = [x[segments.index].transpose(1, 2) for x in (q, k, v)]  # (segments, heads, longest, head_dim)
    out = F.scaled_dot_product_attention(*batched, attn_mask=segments.valid[:, None, None, :])
    return out.transpose(1, 2)[segments.valid]
