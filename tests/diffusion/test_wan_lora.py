"""LoRA on the Wan DiT: starts equal to the base model, trains only adapters, merges back to the base names."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import ConfigError
from loongforge_diffusion.wan.diffusers_adapter import to_diffusers
from loongforge_diffusion.wan.lora import LoRALinear, apply_lora, merge_lora
from loongforge_diffusion.wan.model import WanModel
from wan_reference import max_abs, tiny_flavor

VIDEO = (2, 5, 2, 4, 4)


def _model_and_inputs(task: str = "i2v"):
    torch.manual_seed(0)
    model = WanModel(tiny_flavor(task, 16))
    torch.nn.init.normal_(model.head.proj.weight, std=0.1)  # zero at init, which would hide every gradient
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randn(VIDEO, generator=generator), torch.tensor([10.0, 600.0]),
              torch.randn(2, 7, 16, generator=generator), torch.randn(2, 3, 24, generator=generator))
    return model, inputs


def test_wrapped_model_starts_equal_and_only_adapters_learn():
    model, inputs = _model_and_inputs()
    base_out = model(*inputs)
    wrapped = apply_lora(model, rank=4, alpha=8, dropout=0.1)
    assert len(wrapped) == 2 * 8  # two blocks x (qkv, out, q, kv, kv_img, out, fc1, fc2)
    assert torch.equal(model(*inputs), base_out)  # B = 0: exactly the base model, even with dropout active
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{w}.lora_{ab}" for w in wrapped for ab in "AB"}

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        model(*inputs).square().mean().backward()
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        assert with_grad == trainable
        assert all(model.get_parameter(f"{w}.lora_B").grad.norm() > 0 for w in wrapped)
        if step == 1:  # A's gradient flows through B, which is nonzero only after the first step
            assert all(model.get_parameter(f"{w}.lora_A").grad.norm() > 0 for w in wrapped)
        optimizer.step()


def test_merged_model_equals_unmerged_and_has_the_base_names():
    model, inputs = _model_and_inputs()
    base_names = sorted(model.state_dict())
    base_weights = {n: p.clone() for n, p in model.state_dict().items()}
    apply_lora(model, rank=3, alpha=5)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_B, std=0.05)
    model.eval()
    lora_out = model(*inputs)

    merged = merge_lora(model)

    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert sorted(merged.state_dict()) == base_names
    out = merged(*inputs)
    assert max_abs(out, lora_out) < 1e-5 and lora_out.abs().max() > 0.1
    changed = {n for n, t in merged.state_dict().items() if not torch.equal(t, base_weights[n])}
    assert changed == {n for n in base_names if n.startswith("blocks.") and n.endswith(".weight")
                       and any(part in n for part in ("qkv", "out", ".q.", "kv", "fc"))}
    assert all(not p.requires_grad for p in merged.parameters())


def test_fused_projections_get_one_adapter_each():
    model, _ = _model_and_inputs("t2v")
    before = to_diffusers(model.state_dict())
    apply_lora(model, rank=2, targets=("self_attn.qkv",))
    qkv = model.blocks[0].self_attn.qkv
    assert tuple(qkv.lora_A.shape) == (3, 2, 32) and tuple(qkv.lora_B.shape) == (3, 32, 2)
    with torch.no_grad():
        qkv.lora_B[1].normal_()  # only k's adapter
    after = to_diffusers(merge_lora(model).state_dict())
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert changed == ["blocks.0.attn1.to_k.weight"]
    expected = before["blocks.0.attn1.to_k.weight"] + qkv.lora_B[1] @ qkv.lora_A[1]
    assert max_abs(after["blocks.0.attn1.to_k.weight"], expected) < 1e-6


def test_targets_are_checked():
    model, _ = _model_and_inputs("t2v")
    assert apply_lora(model, rank=2, targets=("ffn",)) == [f"blocks.{i}.ffn.fc{j}" for i in range(2) for j in (1, 2)]
    with pytest.raises(ConfigError, match="already has adapters"):
        apply_lora(model, rank=2)
    with pytest.raises(ConfigError, match="unknown target 'attn'.*self_attn.qkv"):
        apply_lora(WanModel(tiny_flavor("t2v", 16)), rank=2, targets=("attn",))
    assert apply_lora(WanModel(tiny_flavor("t2v", 16)), rank=2, targets=("cross_attn.kv_img",)) == []
