"""The Qwen2-VL / Qwen2.5-VL vision encoder in plain torch: patches + ``grid_thw`` in, LLM-width tokens out.

Pre-norm ViT blocks with a fused ``qkv`` projection and 2D RoPE, attention confined to each frame (and, for
Qwen2.5-VL's windowed blocks, to each window), followed by the patch merger. The patch embedding is the
reference's Conv3d with stride equal to its kernel, i.e. a bias-free linear map of each flattened patch, and is
written as one. Numerically equal to transformers' ``Qwen2VisionTransformerPretrainedModel`` /
``Qwen2_5_VisionTransformerPretrainedModel`` (``pooler_output``) with weights converted by
:mod:`loongforge_vlm.encoders.qwen_vit_adapter`.
"""

from __future__ import annotations

import torch
from loongforge.errors import LoongForgeError
from torch import nn

from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.qwen_vit_layout import Segments, VisionLayout, vision_layout
from loongforge_vlm.encoders.recompute import run_blocks
from loongforge_vlm.encoders.segment_attention import segment_attention
from loongforge_vlm.encoders.vision_rope import apply_rope, rope_tables
from loongforge_vlm.projectors.patch_merger import PatchMerger


def _norm(flavor: QwenViTFlavor) -> nn.Module:
    return nn.RMSNorm(flavor.dim, eps=flavor.eps) if flavor.gated_mlp else nn.LayerNorm(flavor.dim, eps=flavor.eps)


class VisionAttention(nn.Module):
    """Self-attention with fused ``qkv`` (output rows ``[q; k; v]``, each head-major) and 2D RoPE on q and k."""

    def __init__(self, flavor: QwenViTFlavor) -> None:
        super().__init__()
        self.num_heads = flavor.num_heads
        self.qkv = nn.Linear(flavor.dim, 3 * flavor.dim)
        self.out = nn.Linear(flavor.dim, flavor.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.out(segment_attention(q, k, v, segments).flatten(1))


class VisionMLP(nn.Module):
    """QuickGELU MLP (Qwen2-VL) or SwiGLU (Qwen2.5-VL, ``fc1`` rows are ``[gate; up]``); all with biases."""

    def __init__(self, flavor: QwenViTFlavor) -> None:
        super().__init__()
        self.gated = flavor.gated_mlp
        self.fc1 = nn.Linear(flavor.dim, 2 * flavor.ffn_dim if self.gated else flavor.ffn_dim)
        self.fc2 = nn.Linear(flavor.ffn_dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = nn.functional.silu(gate) * up
        else:
            hidden = hidden * torch.sigmoid(1.702 * hidden)
        return self.fc2(hidden)


class VisionBlock(nn.Module):
    """Pre-norm block; ``windowed`` says whether it attends within windows or within whole frames."""

    def __init__(self, flavor: QwenViTFlavor, *, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.attn_norm = _norm(flavor)
        self.attn = VisionAttention(flavor)
        self.mlp_norm = _norm(flavor)
        self.mlp = VisionMLP(flavor)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: VisionLayout) -> torch.Tensor:
        segments = layout.windows if self.windowed else layout.frames
        x = x + self.attn(self.attn_norm(x), rope, segments)
        return x + self.mlp(self.mlp_norm(x))


class QwenViT(nn.Module):
    """Vision encoder + patch merger of one :class:`QwenViTFlavor`."""

    #: Recompute each block in the backward (``VLMFlavor.encoder_recompute`` sets it).
    recompute = False

    def __init__(self, flavor: QwenViTFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        self.patch_embed = nn.Linear(flavor.patch_dim, flavor.dim, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(flavor, windowed=flavor.windowed and index not in flavor.full_attention_blocks)
            for index in range(flavor.num_layers)
        )
        self.merger = PatchMerger(flavor.dim, flavor.out_dim, flavor.merge_unit,
                                  norm="rmsnorm" if flavor.gated_mlp else "layernorm", eps=flavor.eps)

    def layout(self, grid_thw: torch.Tensor, num_patches: int) -> VisionLayout:
        """Positions and attention segments of a batch (depends on ``grid_thw`` only)."""
        window = self.flavor.window_size // self.flavor.merge_patch_pixels if self.flavor.windowed else None
        return vision_layout(grid_thw, num_patches, merge=self.flavor.spatial_merge_size, window_tokens=window)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``(sum t*h*w, patch_dim)`` and ``grid_thw`` ``(images, 3)`` as the Qwen processors give
        them -> ``(sum t*h*w / merge**2, out_dim)`` tokens for the LLM, in image order."""
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self.flavor.patch_dim:
            raise LoongForgeError(f"pixel_values must have shape (patches, {self.flavor.patch_dim}) for this flavor "
                                  "(in_channels * temporal_patch_size * patch_size**2), "
                                  f"got {tuple(pixel_values.shape)}")
        layout = self.layout(grid_thw, pixel_values.shape[0])
        if layout.order is not None:
            pixel_values = pixel_values[layout.order]
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        rope = rope_tables(layout.positions, self.flavor.head_dim, self.flavor.rope_theta)
        x = run_blocks(self.blocks, x, rope, layout, recompute=self.recompute)
        merged = self.merger(x)
        return merged if layout.merged_restore is None else merged[layout.merged_restore]
