"""Qwen3-VL against transformers' ``qwen3_vl``: the vision tower with DeepStack (outputs and gradients), the whole
model's logits with two images of different sizes in one batch (DeepStack injection, interleaved M-RoPE), bitwise
Hugging Face round trips, and the parameter counts of the published sizes."""

from __future__ import annotations

import torch
from loongforge_vlm.encoders.qwen_vit import QwenViT
from loongforge_vlm.encoders.qwen_vit_adapter import from_hf, to_hf
from qwen_vit_reference import QWEN3, batch, max_abs, reference_model, rel_l2

#: Two images and a 2-frame video: learned positions resampled to three grids, attention within each frame.
IMAGES_AND_VIDEO = ((1, 6, 8), (1, 4, 4), (2, 2, 4))


def test_vision_tower_matches_transformers_with_deepstack():
    reference = reference_model(QWEN3)
    ours = QwenViT(QWEN3)
    ours.load_state_dict(from_hf(reference.state_dict(), QWEN3))
    pixels, grid_thw = batch(QWEN3, IMAGES_AND_VIDEO)
    theirs_in, ours_in = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
    output = reference(theirs_in, grid_thw)
    theirs = [output.pooler_output, *output.deepstack_features]
    merged, deepstack = ours.encode(ours_in, grid_thw)
    mine = [merged, *deepstack]
    assert len(mine) == len(theirs) == 1 + len(QWEN3.deepstack_layers)
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=generator) for t in theirs]
    sum((t * w).sum() for t, w in zip(theirs, weights, strict=True)).backward()
    sum((t * w).sum() for t, w in zip(mine, weights, strict=True)).backward()
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == (sum(t * h * w for t, h, w in IMAGES_AND_VIDEO) // 4, QWEN3.out_dim)
        assert b.abs().mean() > 0.1
        assert max_abs(a, b) < 1e-5 and rel_l2(a, b) < 1e-6
    assert max_abs(ours_in.grad, theirs_in.grad) < 1e-5 and rel_l2(ours_in.grad, theirs_in.grad) < 1e-6
    ours_grads = to_hf({name: p.grad for name, p in ours.named_parameters()}, QWEN3)
    for name, grad in reference.named_parameters():
        assert grad.grad.abs().max() > 0, name
        assert rel_l2(ours_grads[name], grad.grad) < 1e-5, name
