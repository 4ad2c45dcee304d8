"""Patch merger: the projector of the Qwen vision encoders.

Normalises each patch, concatenates every ``merge_unit`` consecutive patches (one ``merge x merge`` block: the
encoder keeps them adjacent) and maps the result through a GELU MLP to the language model's width, so the LLM
sees a quarter as many image tokens as the ViT processed. Qwen3-VL's DeepStack mergers normalise after the
concatenation instead (``norm_after_merge``: one norm over the merged vector).
"""

from __future__ import annotations

import torch
from torch import nn


class PatchMerger(nn.Module):
    """``norm -> concat merge_unit patches -> fc1 -> GELU -> fc2``.

    :param norm: ``"layernorm"`` (Qwen2-VL, Qwen3-VL) or ``"rmsnorm"`` (Qwen2.5-VL).
    :param norm_after_merge: normalise the concatenated ``merge_unit * dim`` vector (Qwen3-VL's DeepStack).
    """

    def __init__(self, dim: int, out_dim: int, merge_unit: int, *, norm: str, eps: float = 1e-6,
                 norm_after_merge: bool = False) -> None:
        super().__init__()
        norms = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
        if norm not in norms:
            raise ValueError(f"patch merger: norm must be one of {sorted(norms)}, got {norm!r}")
        self.merged_dim = dim * merge_unit
        self.norm_after_merge = norm_after_merge
        self.norm = norms[norm](self.merged_dim if norm_after_merge else dim, eps=eps)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``(patches, dim)`` -> ``(patches / merge_unit, out_dim)``."""
        if self.norm_after_merge:
            merged = self.norm(patches.reshape(-1, self.merged_dim))
        else:
            merged = self.norm(patches).reshape(-1, self.merged_dim)
        return self.fc2(nn.functional.gelu(self.fc1(merged)))
