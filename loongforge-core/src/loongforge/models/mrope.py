"""Interleaved multimodal RoPE (Qwen3-VL's ``mrope_interleaved``) on megatron's ``GPTModel``.

Megatron's ``MultimodalRotaryEmbedding`` gives each of the (temporal, height, width) position rows one contiguous
block of rotary frequencies (Qwen2-VL's M-RoPE). Qwen3-VL interleaves them instead -- frequency ``j`` follows
height when ``j % 3 == 1`` and ``j < 3 * sections[1]``, width when ``j % 3 == 2`` and ``j < 3 * sections[2]``,
time otherwise -- so each axis sees the whole frequency range. Only which position row drives each frequency
changes; the rotation itself (rotate-half over ``[freqs, freqs]``) and the output layout ``[seq, batch, 1, dim]``
are megatron's, so attention applies it unchanged. A wrapper around the model's own rotary module rather than a
replacement, so the inverse frequencies core assigns to it (:func:`loongforge.models.rope.rope_inv_freq`) stay the
ones used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def interleaved_mrope_axes(sections: Sequence[int], frequencies: int) -> torch.Tensor:
    """The position row (0 time, 1 height, 2 width) that drives each of ``frequencies`` rotary frequencies."""
    index = torch.arange(frequencies)
    axes = torch.zeros(frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[(index % 3 == axis) & (index < 3 * sections[axis])] = axis
    return axes


class InterleavedMultimodalRotary(nn.Module):
    """Called as ``GPTModel`` calls its M-RoPE module: ``(position_ids (3, B, S), mrope_section, cp_group)`` ->
    ``[S, B, 1, head_dim]`` angles (this context-parallel rank's slice)."""

    def __init__(self, inner: nn.Module, sections: Sequence[int]) -> None:
        super().__init__()
        self.inner = inner
        self.sections = tuple(sections)

    def forward(self, position_ids: torch.Tensor, mrope_section: Any = None, cp_group: Any = None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

        inv_freq = self.inner.inv_freq
        freqs = position_ids.to(device=inv_freq.device, dtype=torch.float32)[..., None] * inv_freq  # (3, B, S, F)
        axes = interleaved_mrope_axes(self.sections, inv_freq.shape[0]).to(inv_freq.device)
        chosen = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((chosen, chosen), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.inner.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
