"""transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers built from a LoongForge flavor, plus a test batch."""

from __future__ import annotations

import math

import torch
from loongforge_vlm.encoders.qwen_vit_flavors import FLAVORS, QwenViTFlavor
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

QWEN2 = FLAVORS["qwen2-vl-vit-tiny"]
QWEN25 = FLAVORS["qwen2.5-vl-vit-tiny"]
QWEN3 = FLAVORS["qwen3-vl-vit-tiny"]

#: Two images of different resolutions: 6x8 patches (3x4 merged tokens: with 2x2-token windows the bottom and
#: right windows are partial) and 4x4 patches (one window, which transformers pads with an empty one).
TWO_IMAGES = ((1, 6, 8), (1, 4, 4))


def hf_config(flavor: QwenViTFlavor):
    """The transformers vision config that ``flavor`` describes."""
    common = dict(depth=flavor.num_layers, num_heads=flavor.num_heads, in_channels=flavor.in_channels,
                  patch_size=flavor.patch_size, temporal_patch_size=flavor.temporal_patch_size,
                  spatial_merge_size=flavor.spatial_merge_size,
                  rope_parameters={"rope_type": "axial", "rope_theta": flavor.rope_theta})
    if flavor.family == "qwen3-vl":
        return Qwen3VLVisionConfig(hidden_size=flavor.dim, intermediate_size=flavor.ffn_dim,
                                   hidden_act="gelu_pytorch_tanh", out_hidden_size=flavor.out_dim,
                                   num_position_embeddings=flavor.num_position_embeddings,
                                   deepstack_visual_indexes=list(flavor.deepstack_layers), **common)
    if flavor.family == "qwen2-vl":
        assert flavor.ffn_dim % flavor.dim == 0
        return Qwen2VLVisionConfig(embed_dim=flavor.dim, hidden_size=flavor.out_dim, hidden_act="quick_gelu",
                                   mlp_ratio=flavor.ffn_dim // flavor.dim, **common)
    return Qwen2_5_VLVisionConfig(hidden_size=flavor.dim, intermediate_size=flavor.ffn_dim, hidden_act="silu",
                                  out_hidden_size=flavor.out_dim, window_size=flavor.window_size,
                                  fullatt_block_indexes=list(flavor.full_attention_blocks), **common)


def reference_class(flavor: QwenViTFlavor) -> type[torch.nn.Module]:
    if flavor.family == "qwen2-vl":
        return Qwen2VisionTransformerPretrainedModel
    if flavor.family == "qwen3-vl":
        return Qwen3VLVisionModel
    return Qwen2_5_VisionTransformerPretrainedModel


def reference_model(flavor: QwenViTFlavor, seed: int = 0) -> torch.nn.Module:
    """transformers' tower with O(1)-scale random weights (its own init is too small to expose errors)."""
    model = reference_class(flavor)(hf_config(flavor)).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim > 1:
                param.copy_(noise / math.sqrt(param[0].numel()))
            elif "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return model


def batch(flavor: QwenViTFlavor, grids=TWO_IMAGES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` and ``grid_thw`` as the Qwen image processor lays them out."""
    grid_thw = torch.tensor(grids)
    patches = int(grid_thw.prod(-1).sum())
    return torch.randn(patches, flavor.patch_dim, generator=torch.Generator().manual_seed(seed)), grid_thw


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())
