"""DPO under LoRA: the reference is the policy with its adapters off, and DPO of the adapted model equals DPO of the
merged model against a frozen copy of the base -- the loss within 1e-6 and the adapters' gradients exactly what the
chain rule makes of the merged weights' gradients (``W' = W + s B A``: ``dL/dB = s G A^T``, ``dL/dA = s B^T G``) --
at step 0 (``B = 0``: the adapted model, the adapters-off reference and the base are one model, bitwise) and with
trained adapters. Without LoRA the reference is a frozen copy, which at step 0 computes the policy's log-probs
bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge.config.schema import DataConfig, DPOConfig, LoRAConfig
from loongforge.data.preference_dataset import shipped_preference
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.models.decoder_model import build_model
from loongforge.models.llama import FLAVORS
from loongforge.models.lora import LoRAAdapter, adapters_disabled, apply_lora, merge_lora_state_dict
from loongforge.train.preference.objective import REFERENCE_LOGPS, PreferenceObjective

LORA = LoRAConfig(rank=4, alpha=8, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
OBJECTIVE = PreferenceObjective.of(DPOConfig(loss_type="sigmoid", beta=0.1))


def _model(backend):
    """llama-debug with the same initial weights every time, in float64 (merging then rounds nothing that matters)."""
    torch.manual_seed(0)
    return build_model(FLAVORS["llama-debug"], backend=backend).double()


@pytest.fixture(scope="module")
def batch():
    rows, _ = shipped_preference([], ByteTokenizer()).split_samples(DataConfig(seq_length=128))
    return rows.batch(np.arange(4))


def _per_token(model, batch):
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _logps(model, batch):
    with torch.no_grad():
        return OBJECTIVE.logps(_per_token(model, batch), batch["loss_mask"])


def _dpo(policy, reference_logps, batch):
    """The engine's loss of ``batch`` for ``policy`` against the given reference log-probs, and its gradients."""
    loss, _ = OBJECTIVE.loss({**batch, REFERENCE_LOGPS: reference_logps}, _per_token(policy, batch))
    loss.backward()
    return loss.item()


def _adapted_layers(model):
    return {name.removesuffix(".lora"): module for name, module in model.named_modules()
            if isinstance(module, LoRAAdapter)}


def _randomise(model):
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".lora.weight_b"):
                param.normal_(0.0, 0.05, generator=generator)


@pytest.mark.parametrize("trained", [False, True], ids=["step0", "trained-adapters"])
def test_lora_dpo_equals_merged_model_dpo(megatron_cpu_world, batch, trained):
    base = _model(megatron_cpu_world)
    adapted = _model(megatron_cpu_world)
    apply_lora([adapted], LORA, seed=1)
    if trained:
        _randomise(adapted)
    with adapters_disabled([adapted]):
        reference = _logps(adapted, batch)
    assert torch.equal(reference, _logps(base, batch))  # adapters off is the base model, bitwise
    if not trained:  # B = 0: the adapted model is the base model too
        assert torch.equal(_logps(adapted, batch), reference)
    merged = _model(megatron_cpu_world)
    state = {k: v for k, v in adapted.state_dict().items() if not k.endswith("_extra_state")}
    merged.load_state_dict(merge_lora_state_dict(state, LORA), strict=False)

    lora_loss = _dpo(adapted, reference, batch)
    merged_loss = _dpo(merged, _logps(base, batch), batch)  # a frozen copy of the base as the reference
    assert abs(lora_loss - merged_loss) <= 1e-6, (lora_loss, merged_loss)
    if not trained:
        assert lora_loss == pytest.approx(np.log(2), abs=1e-12)  # the policy is its reference
    merged_params = dict(merged.named_parameters())
    scaling = LORA.alpha / LORA.rank
    layers = _adapted_layers(adapted)
    assert len(layers) == 2 * 4
    for name, layer in layers.items():
        g = merged_params[f"{name}.weight"].grad
        a, b = layer.weight_a.detach(), layer.weight_b.detach()
        assert g.abs().max() > 1e-4, name  # a real gradient reaches every adapted weight
        if not trained:
            assert not layer.weight_a.grad.any()  # B = 0: nothing reaches A yet
        for grad, expected in ((layer.weight_b.grad, scaling * g @ a.T), (layer.weight_a.grad, scaling * b.T @ g)):
            # to 1e-6 of the gradient's size: megatron's cross-entropy backward runs in float32
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6 * expected.abs().max().item())
    assert all(p.grad is None for n, p in adapted.named_parameters() if ".lora." not in n)  # the base is frozen


def test_frozen_copy_computes_exactly_what_the_policy_does(megatron_cpu_world, batch):
    """The copy's log-probs equal the policy's bitwise at a width (256) where megatron's frozen-weight linear takes
    another GEMM than a trained one on the CPU: the copy keeps the policy's ``requires_grad`` flags."""
    from loongforge.models.llama import FLAVORS
    from loongforge.train.preference.reference import copy_weights

    flavor = FLAVORS["llama-tiny"]
    torch.manual_seed(3)
    policy = build_model(flavor, backend=megatron_cpu_world)
    policy.embedding.requires_grad_(False)  # a frozen part (model.freeze) stays frozen in the copy
    copy = build_model(flavor, backend=megatron_cpu_world)
    copy_weights(policy, copy)
    copy.eval()
    assert [p.requires_grad for p in copy.parameters()] == [p.requires_grad for p in policy.parameters()]
    assert torch.equal(_logps(copy, batch), _logps(policy.eval(), batch))
