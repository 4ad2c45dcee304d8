"""transformers' whole Qwen2-VL / Qwen2.5-VL models built from a LoongForge flavor, and a mixed test batch.

The batch holds two samples: an 8x12-patch image (4x6 merged tokens) between text, and a 4x4-patch image
(2x2 tokens) plus -- for flavors with a video token -- a 2-frame 4x8-patch video, left-padded. Token ids stay
below the vision ids so the only placeholders are the ones placed here.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from loongforge_vlm.model.flavors import VLMFlavor
from loongforge_vlm.model.hf_interop import hf_config_dict

IMAGE_GRIDS = ((1, 8, 12), (1, 4, 4))
VIDEO_GRIDS = ((2, 4, 8),)
#: Sample 1 is left-padded by this many tokens.
LEFT_PAD = 3


def hf_config(flavor: VLMFlavor):
    config_class = getattr(transformers, flavor.hf_architecture.replace("ForConditionalGeneration", "Config"))
    return config_class(**hf_config_dict(flavor), attn_implementation="eager")


def reference_model(flavor: VLMFlavor, seed: int = 0):
    """A random fp32 transformers VLM with weights of a wide spread (its own init is too small to expose a
    mis-mapped head, bias, norm or rotary section)."""
    model_class = getattr(transformers, flavor.hf_architecture)
    return perturbed(model_class(hf_config(flavor)), seed)


def perturbed(model, seed: int = 0):
    """``model`` in fp32 eval mode with every weight redrawn at a wide spread (see :func:`reference_model`)."""
    model = model.float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim > 1:
                param.copy_(noise * (0.15 if "language_model" in name or "lm_head" in name
                                     else param[0].numel() ** -0.5))
            elif "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.25 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                param.copy_(0.3 * noise)
    return model


def _tokens(generator: torch.Generator, count: int) -> list[int]:
    return torch.randint(0, 300, (count,), generator=generator).tolist()


def _vision(flavor: VLMFlavor, token: int, grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    count = t * h * w // flavor.spatial_merge_size ** 2
    return [flavor.vision_start_token_id, *[token] * count, flavor.vision_end_token_id]


def mixed_batch(flavor: VLMFlavor, *, video: bool | None = None, seed: int = 1) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``mm_token_type_ids``, pixels and grids for both models."""
    video = flavor.video_token_id is not None if video is None else video
    generator = torch.Generator().manual_seed(seed)
    image, vid = flavor.image_token_id, flavor.video_token_id
    first = _tokens(generator, 5) + _vision(flavor, image, IMAGE_GRIDS[0]) + _tokens(generator, 7)
    second = _tokens(generator, 4) + _vision(flavor, image, IMAGE_GRIDS[1]) + _tokens(generator, 3)
    if video:
        second += _vision(flavor, vid, VIDEO_GRIDS[0]) + _tokens(generator, 2)
    length = max(len(first), len(second) + LEFT_PAD)
    rows, masks = [], []
    for sample, pad_left in ((first, 0), (second, length - len(second))):
        pad_right = length - len(sample) - pad_left
        rows.append([0] * pad_left + sample + [0] * pad_right)
        masks.append([0] * pad_left + [1] * len(sample) + [0] * pad_right)
    input_ids = torch.tensor(rows)
    types = torch.zeros_like(input_ids)
    types[input_ids == image] = 1
    if vid is not None:
        types[input_ids == vid] = 2
    encoder = flavor.encoder
    out = {"input_ids": input_ids, "attention_mask": torch.tensor(masks), "mm_token_type_ids": types,
           "image_grid_thw": torch.tensor(IMAGE_GRIDS)}
    out["pixel_values"] = torch.randn(int(out["image_grid_thw"].prod(-1).sum()), encoder.patch_dim,
                                      generator=generator)
    if video:
        out["video_grid_thw"] = torch.tensor(VIDEO_GRIDS)
        out["pixel_values_videos"] = torch.randn(int(out["video_grid_thw"].prod(-1).sum()), encoder.patch_dim,
                                                 generator=generator)
    return out


@contextlib.contextmanager
def megatron_world():
    """Core's one-process CPU world (gloo, TP=PP=1), yielding the backend."""
    from loongforge.interop.world import standalone_world

    with standalone_world() as backend:
        yield backend
