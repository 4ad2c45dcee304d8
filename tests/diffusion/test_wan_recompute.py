"""``recompute=True`` (activation checkpointing per block) changes no output or gradient bit: the Wan DiT and the
Qwen-Image MMDiT."""

from __future__ import annotations

import torch
from loongforge_diffusion.qwen_image.flavors import FLAVORS as QWEN_FLAVORS
from loongforge_diffusion.qwen_image.model import QwenImageModel
from loongforge_diffusion.wan.model import WanModel
from wan_reference import tiny_flavor


def _assert_recompute_is_exact(plain: torch.nn.Module, recomputed: torch.nn.Module, forward,
                               unreached: str = "-") -> None:
    """Perturb ``plain`` away from its init, copy it into ``recomputed``; both outputs and every gradient equal, and
    every parameter but those named ``unreached...`` has a nonzero one."""
    with torch.no_grad():
        for param in plain.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    recomputed.load_state_dict(plain.state_dict())
    outputs = []
    for model in (plain, recomputed):
        out = forward(model)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name
        assert name.startswith(unreached) or a.grad.norm() > 0, name


def test_recomputed_wan_blocks_give_bitwise_equal_gradients():
    torch.manual_seed(0)
    flavor = tiny_flavor("ti2v", 16)
    video, context = torch.randn(2, 5, 3, 4, 6), torch.randn(2, 7, 16)
    timestep = torch.rand(2, 18) * 1000
    _assert_recompute_is_exact(WanModel(flavor), WanModel(flavor, recompute=True),
                               lambda model: model(video, timestep, context))


def test_recomputed_qwen_image_blocks_give_bitwise_equal_gradients():
    torch.manual_seed(0)
    flavor = QWEN_FLAVORS["qwen-image-tiny"]
    image, context = torch.randn(2, 12, flavor.in_channels), torch.randn(2, 5, flavor.text_dim)
    mask, sigma = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool), torch.rand(2)
    _assert_recompute_is_exact(QwenImageModel(flavor), QwenImageModel(flavor, recompute=True),
                               lambda model: model(image, context, mask, sigma, [(1, 3, 4)] * 2),
                               unreached=f"blocks.{flavor.num_layers - 1}.txt.")  # the head reads image tokens
