"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision encoder in plain torch: patches + ``grid_thw`` in, LLM-width
tokens out.

Pre-norm ViT blocks with a fused ``qkv`` projection and 2D RoPE, attention confined to each frame (and, for
Qwen2.5-VL's windowed blocks, to each window), followed by the patch merger. The patch embedding is the
reference's Conv3d with stride equal to its kernel, i.e. a linear map of each flattened patch, and is written as
one. Qwen3-VL adds learned absolute positions (:mod:`loongforge_vlm.encoders.position_grid`) to the embedded
patches and DeepStack: the outputs of chosen blocks pass through mergers of their own, giving one more set of
LLM-width tokens per chosen block, which the language model adds to its first hidden states. Numerically equal
to transformers' ``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel`` /
``Qwen3VLVisionModel`` (``pooler_output``, ``deepstack_features``) with weights converted by
:mod:`loongforge_vlm.encoders.qwen_vit_adapter`.
"""

from __future__ import annotations

import torch
from loongforge.errors import LoongForgeError
from torch import nn

from loongforge_vlm.encoders.position_grid import interpolated_positions
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.qwen_vit_layout import Segments, VisionLayout, vision_layout
from loongforge_vlm.encoders.recompute import run_blocks
from loongforge_vlm.encoders.segment_attention import segment_attention
from loongforge_vlm.encoders.tensor_parallel import sharded_state_dict
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


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


#: The plain MLPs' activations, by transformers' names.
_ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu_pytorch_tanh": _tanh_gelu}


class VisionMLP(nn.Module):
    """QuickGELU MLP (Qwen2-VL), tanh-GELU MLP (Qwen3-VL) or SwiGLU (Qwen2.5-VL, ``fc1`` rows are
    ``[gate; up]``); all with biases."""

    def __init__(self, flavor: QwenViTFlavor) -> None:
        super().__init__()
        self.gated = flavor.gated_mlp
        self.act = None if self.gated else _ACTIVATIONS[flavor.activation]
        self.fc1 = nn.Linear(flavor.dim, 2 * flavor.ffn_dim if self.gated else flavor.ffn_dim)
        self.fc2 = nn.Linear(flavor.ffn_dim, flavor.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = nn.functional.silu(gate) * up
        else:
            hidden = self.act(hidden)
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
    """Vision encoder + patch merger (+ DeepStack mergers) of one :class:`QwenViTFlavor`."""

    #: Recompute each block in the backward (``VLMFlavor.encoder_recompute`` sets it).
    recompute = False

    def __init__(self, flavor: QwenViTFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        self.patch_embed = nn.Linear(flavor.patch_dim, flavor.dim, bias=flavor.learned_positions)
        if flavor.learned_positions:
            self.pos_embed = nn.Embedding(flavor.num_position_embeddings, flavor.dim)
        self.blocks = nn.ModuleList(
            VisionBlock(flavor, windowed=flavor.windowed and index not in flavor.full_attention_blocks)
            for index in range(flavor.num_layers)
        )
        norm = "rmsnorm" if flavor.gated_mlp else "layernorm"
        self.merger = PatchMerger(flavor.dim, flavor.out_dim, flavor.merge_unit, norm=norm, eps=flavor.eps)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(flavor.dim, flavor.out_dim, flavor.merge_unit, norm=norm, eps=flavor.eps,
                        norm_after_merge=True)
            for _ in flavor.deepstack_layers
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron's distributed-checkpoint view: replicated tensors, and at encoder tp > 1 each shard's place in
        the full tensor (:mod:`loongforge_vlm.encoders.tensor_parallel`)."""
        return sharded_state_dict(self, prefix, sharded_offsets)

    def layout(self, grid_thw: torch.Tensor, num_patches: int) -> VisionLayout:
        """Positions and attention segments of a batch (depends on ``grid_thw`` only)."""
        window = self.flavor.window_size // self.flavor.merge_patch_pixels if self.flavor.windowed else None
        return vision_layout(grid_thw, num_patches, merge=self.flavor.spatial_merge_size, window_tokens=window)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``(sum t*h*w, patch_dim)`` and ``grid_thw`` ``(images, 3)`` as the Qwen processors give
        them -> ``(sum t*h*w / merge**2, out_dim)`` tokens for the LLM, in image order."""
        return self.encode(pixel_values, grid_thw)[0]

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tokens :meth:`forward` returns and, from the same pass, one tensor of the same shape per DeepStack
        block (empty for Qwen2-VL / Qwen2.5-VL), in ``deepstack_layers`` order."""
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self.flavor.patch_dim:
            raise LoongForgeError(f"pixel_values must have shape (patches, {self.flavor.patch_dim}) for this flavor "
                                  "(in_channels * temporal_patch_size * patch_size**2), "
                                  f"got {tuple(pixel_values.shape)}")
        layout = self.layout(grid_thw, pixel_values.shape[0])
        if layout.order is not None:
            pixel_values = pixel_values[layout.order]
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        if self.flavor.learned_positions:
            x = x + interpolated_positions(self.pos_embed.weight, layout.positions, self._patch_grid_sizes(grid_thw))
        rope = rope_tables(layout.positions, self.flavor.head_dim, self.flavor.rope_theta)
        deepstack: list[torch.Tensor] = []
        levels = {block: level for level, block in enumerate(self.flavor.deepstack_layers)}

        def tap(index: int, hidden: torch.Tensor) -> None:
            if index in levels:
                deepstack.append(self.deepstack_mergers[levels[index]](hidden))

        x = run_blocks(self.blocks, x, rope, layout, recompute=self.recompute, after=tap)
        merged = [self.merger(x), *deepstack]
        if layout.merged_restore is not None:
            merged = [tokens[layout.merged_restore] for tokens in merged]
        return merged[0], merged[1:]

    @staticmethod
    def _patch_grid_sizes(grid_thw: torch.Tensor) -> torch.Tensor:
        """Each patch's image size ``(rows, columns)`` in patches, ``(patches, 2)``."""
        return grid_thw[:, 1:].repeat_interleave(grid_thw.prod(-1), dim=0)
