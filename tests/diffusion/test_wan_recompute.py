"""``WanModel(recompute=True)`` (activation checkpointing per block) changes no output or gradient bit."""

from __future__ import annotations

import torch
from loongforge_diffusion.wan.model import WanModel
from wan_reference import tiny_flavor


def test_recomputed_blocks_give_bitwise_equal_gradients():
    torch.manual_seed(0)
    flavor = tiny_flavor("ti2v", 16)
    plain, recomputed = WanModel(flavor), WanModel(flavor, recompute=True)
    with torch.no_grad():
        for param in plain.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    recomputed.load_state_dict(plain.state_dict())
    video, context = torch.randn(2, 5, 3, 4, 6), torch.randn(2, 7, 16)
    timestep = torch.rand(2, 18) * 1000
    outputs = []
    for model in (plain, recomputed):
        out = model(video, timestep, context)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert a.grad.norm() > 0 and torch.equal(a.grad, b.grad), name
