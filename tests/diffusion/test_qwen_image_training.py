"""The tiny Qwen-Image learns: flow matching on moving-squares frames treated as images (pixel space, 2x2 packing).

From the adaLN-Zero start (prediction 0, loss ``E|eps - x0|^2``) 40 AdamW steps must more than halve the loss,
which needs gradients through every path: the head first, then gates, attention and the text conditioning.
"""

from __future__ import annotations

import torch
from loongforge_diffusion.data.moving_squares import MovingSquares
from loongforge_diffusion.flow_matching import FlowMatchingConfig, interpolate, sample_sigmas, velocity_target
from loongforge_diffusion.qwen_image.flavors import FLAVORS
from loongforge_diffusion.qwen_image.model import QwenImageModel, pack_latents

BATCH, STEPS = 16, 40


def test_flow_matching_on_squares_halves_the_loss():
    torch.manual_seed(0)
    flavor = FLAVORS["qwen-image-tiny"].with_overrides(in_channels=12, out_channels=3, text_dim=32)
    model = QwenImageModel(flavor)
    items = [MovingSquares(BATCH, text_dim=32)[i] for i in range(BATCH)]
    x0 = pack_latents(torch.stack([item["video"][:, 0] for item in items]))  # first frames, 16x16 RGB -> 64 tokens
    context = torch.stack([item["context"] for item in items])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        sigma = sample_sigmas(BATCH, FlowMatchingConfig(), generator)
        noise = torch.randn(x0.shape, generator=generator)
        prediction = model(interpolate(x0, noise, sigma), context, None, sigma, [(1, 8, 8)] * BATCH)
        loss = (prediction - velocity_target(x0, noise)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
