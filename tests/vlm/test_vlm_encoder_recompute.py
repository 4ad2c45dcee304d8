"""``encoder_recompute`` (the vision tower's own activation recompute) leaves the loss and every gradient bitwise
unchanged, for the Qwen ViT and for SigLIP, and keeps the parameter names (checkpoints still load)."""

from __future__ import annotations

import pytest
import torch
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.vlm import build_vlm
from vlm_reference import megatron_world, mixed_batch


@pytest.fixture(scope="module")
def world():
    with megatron_world() as backend:
        yield backend


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], None, batch["attention_mask"], **batch["vision"])
    loss = logits.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(name):
    if name == "vlm-tiny":
        ids = torch.full((1, 24), 7)
        ids[0, 2:18] = FLAVORS[name].image_token_id  # 16 tokens: one 32x32 image, 8x8 patches merged 2x2
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "vision": {"pixel_values": pixels}}
    batch = mixed_batch(FLAVORS[name], video=False)
    batch["vision"] = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    return batch


@pytest.mark.parametrize("name", ["qwen2-vl-tiny", "vlm-tiny"])
def test_encoder_recompute_is_bitwise_the_same(world, name):
    flavor = FLAVORS[name]
    plain = build_vlm(flavor, backend=world)
    recomputed = build_vlm(flavor.with_overrides(encoder_recompute=True), backend=world)
    assert recomputed.encoder.recompute and not plain.encoder.recompute
    recomputed.load_state_dict(plain.state_dict())  # same names, so the same checkpoints load
    batch = _batch(name)
    loss, grads = _loss_and_grads(plain, batch)
    loss_r, grads_r = _loss_and_grads(recomputed, batch)
    assert torch.equal(loss, loss_r) and grads.keys() == grads_r.keys()
    assert any(n.startswith("encoder.") for n in grads)
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads)
