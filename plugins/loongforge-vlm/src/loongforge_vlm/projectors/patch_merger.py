"""Patch merger: the projector of the Qwen vision encoders.

Normalises each patch, concatenates every ``merge_unit`` consecutive patches (one ``merge x merge`` block: the
encoder keeps them adjacent) and maps the result through a GELU MLP to the language model's width, so the LLM
sees a quarter as many image tokens as the ViT processed.
"""

from __future__ import annotations

import torch
from torch import nn


class PatchMerger(nn.Module):
    """``norm -> concat merge_unit patches -> fc1 -> GELU -> fc2``.

    :param norm: ``"layernorm"`` (Qwen2-VL) or ``"rmsnorm"`` (Qwen2.5-VL).
    """

    def __init__(self, dim: int, out_dim: int, merge_unit: int, *, norm: str, eps: float = 1e-6) -> None:
        super().__init__()
        norms = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
        if norm not in norms:
            raise ValueError(f"patch merger: norm must be one of {sorted(norms)}, got {norm!r}")
        self.merged_dim = dim * merge_unit
        self.norm = norms[norm](dim, eps=eps)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``(patches, dim)`` -> ``(patches / merge_unit, out_dim)``."""
        merged = self.norm(patches).reshape(-1, self.merged_dim)
        return self.fc2(nn.functional.gelu(self.fc1(merged)))
