"""Shared helpers for the Qwen-Image tests: diffusers' model built tiny with weights that expose mis-mappings.

diffusers initialises every RMSNorm scale to 1 and leaves the q and k projections statistically alike, so a
converter that swapped ``norm_q``/``norm_k`` or the image/text projections would still pass on default weights.
Every parameter is therefore redrawn: matrices ~ N(0, 1/fan_in), vectors ~ N(0, 0.3), norm scales around 1.
"""

from __future__ import annotations

import torch
from diffusers import QwenImageTransformer2DModel
from loongforge_diffusion.qwen_image.diffusers_adapter import diffusers_config
from loongforge_diffusion.qwen_image.flavors import FLAVORS, QwenImageFlavor

#: Two tiny sizes: the registered one (head 16, RoPE axes 4/6/6: three rotary pairs per spatial axis) and one
#: whose axes follow the real model's 2:7:7 proportion with a different frame width.
TINY = FLAVORS["qwen-image-tiny"]
TINY_WIDE = TINY.with_overrides(num_heads=3, head_dim=32, axes_dims=(4, 14, 14), text_dim=40, num_layers=3)


@torch.no_grad()
def reference_model(flavor: QwenImageFlavor, seed: int = 0) -> QwenImageTransformer2DModel:
    model = QwenImageTransformer2DModel(**diffusers_config(flavor))
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim == 2:
            param.copy_(noise / param.shape[1] ** 0.5)
        else:
            param.copy_(noise * 0.3 + (1.0 if "norm" in name else 0.0))
    return model
