"""``task.recompute``: every policy family's layers recompute in backward with the same gradients and fewer saved
activations, and parameter names stay as they are (checkpoints and weight conversion are unaffected)."""

from __future__ import annotations

import pytest
import torch
from loongforge_embodied.policies.flavors import FLAVORS as PI_FLAVORS
from loongforge_embodied.policies.gr00t_flavors import FLAVORS as GR00T_FLAVORS
from loongforge_embodied.policies.pi05_gemma_flavors import FLAVORS as GEMMA_FLAVORS
from loongforge_embodied.policies.recompute import checkpoint_layers

FLAVORS = {"pi0-tiny": PI_FLAVORS["pi0-tiny"], "pi05-tiny": PI_FLAVORS["pi05-tiny"],
           "gr00t-tiny": GR00T_FLAVORS["gr00t-tiny"], "pi05-gemma-tiny": GEMMA_FLAVORS["pi05-gemma-tiny"]}


def batch(flavor, size: int = 2, horizon: int = 4):
    gen = torch.Generator().manual_seed(0)
    frames = [flavor.frame_inputs("reach the goal", torch.rand(3, generator=gen) * 2 - 1) for _ in range(size)]
    inputs = {key: torch.stack([f[key] for f in frames]) for key in frames[0]}
    if flavor.cameras:
        inputs["images"] = torch.rand(size, flavor.cameras, 3, flavor.image_size, flavor.image_size, generator=gen)
    noisy = torch.randn(size, horizon, flavor.max_action_dim, generator=gen)
    return inputs, noisy, torch.rand(size, generator=gen)


def loss_and_saved(model, inputs, noisy, t):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        loss = model(inputs, noisy, t).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_recompute_keeps_gradients_and_saves_less(name):
    flavor = FLAVORS[name]
    inputs, noisy, t = batch(flavor)
    torch.manual_seed(0)
    plain = flavor.build_policy()
    torch.manual_seed(0)
    recomputed = flavor.build_policy()
    names = [n for n, _ in recomputed.named_parameters()]
    assert checkpoint_layers(recomputed) > 0
    assert [n for n, _ in recomputed.named_parameters()] == names
    loss, grads, saved = loss_and_saved(plain, inputs, noisy, t)
    loss_r, grads_r, saved_r = loss_and_saved(recomputed, inputs, noisy, t)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys()
    for key in grads:
        torch.testing.assert_close(grads_r[key], grads[key], rtol=1e-6, atol=1e-7)
    assert saved_r < 0.7 * saved, (saved_r, saved)
