"""LoRA on a megatron llama-debug: identity at init, gradients only on adapters, exact merge, freezing by pattern."""

from __future__ import annotations

import pytest
import torch
from loongforge.config import load_config  # noqa: E402
from loongforge.config.schema import LoRAConfig  # noqa: E402
from loongforge.devices.cpu import CPUBackend  # noqa: E402
from loongforge.errors import ConfigError  # noqa: E402
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.llama import FLAVORS  # noqa: E402
from loongforge.models.lora import (  # noqa: E402
    apply_adapters,
    apply_lora,
    check_lora_settings,
    freeze_parameters,
    merge_lora,
    merge_lora_state_dict,
)


class NoBF16Backend(CPUBackend):
    """A device that declares no bf16 through the backend contract (``DeviceBackend.supports``)."""

    name = "no-bf16"

    def supports(self, feature):
        return feature != "bf16" and super().supports(feature)


ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _model(backend):
    torch.manual_seed(0)
    return build_model(FLAVORS["llama-debug"], backend=backend).eval()


def _inputs():
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(3))
    return tokens, torch.arange(16).unsqueeze(0).expand(2, -1)


def _logits(model):
    tokens, positions = _inputs()
    return model(tokens, positions, None)


def _randomise_adapters(model, seed=5):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora." in name:
                param.normal_(0.0, 0.1, generator=generator)


def test_adapters_start_as_identity_and_only_they_get_gradients(megatron_cpu_world):
    model = _model(megatron_cpu_world)
    before = _logits(model).detach()
    adapted = apply_lora([model], LoRAConfig(rank=4, alpha=8, targets=ALL_TARGETS), seed=1)
    assert len(adapted) == 2 * 4  # two layers, four targets each
    assert torch.equal(_logits(model), before)  # B = 0: exactly the base model
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"decoder.layers.{i}.{m}.{t}.lora.weight_{w}" for i in range(2)
                               for m, t in [("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                                            ("mlp", "linear_fc1"), ("mlp", "linear_fc2")] for w in "ab")
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.lora.weight_a.shape == (4, 64) and qkv.lora.weight_b.shape == (qkv.weight.shape[0], 4)
    tokens, positions = _inputs()
    model.train()
    model(tokens, positions, None, labels=tokens).mean().backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert with_grad == trainable
    # At init B = 0, so only B's gradient is non-zero; A learns once B has moved.
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("weight_b"))


def test_merged_model_and_merged_state_dict_match_the_adapted_model(megatron_cpu_world):
    lora = LoRAConfig(rank=4, alpha=16, targets=ALL_TARGETS)
    model = _model(megatron_cpu_world)
    base = _logits(model).detach()
    apply_lora([model], lora, seed=1)
    _randomise_adapters(model)
    adapted = _logits(model).detach()
    assert (adapted - base).abs().max() > 1e-2  # the adapters really change the output
    merged_state = merge_lora_state_dict(
        {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, lora
    )
    merge_lora(model)
    assert not [n for n, _ in model.named_parameters() if "lora" in n]
    assert (_logits(model) - adapted).abs().max().item() <= 1e-5
    plain = _model(megatron_cpu_world)  # a model built without LoRA takes the merged state dict strictly
    plain.load_state_dict(merged_state, strict=False)
    assert set(merged_state) == {k for k in plain.state_dict() if not k.endswith("_extra_state")}
    assert (_logits(plain) - adapted).abs().max().item() <= 1e-5


def test_adapters_are_seeded_by_name_not_by_global_rng(megatron_cpu_world):
    first, second = _model(megatron_cpu_world), _model(megatron_cpu_world)
    apply_lora([first], LoRAConfig(rank=2), seed=9)
    torch.manual_seed(123)  # a different global RNG state must not matter
    apply_lora([second], LoRAConfig(rank=2), seed=9)
    a = dict(first.named_parameters())
    assert all(torch.equal(p, a[n]) for n, p in second.named_parameters() if "lora" in n)
    assert not torch.equal(a["decoder.layers.0.self_attention.linear_qkv.lora.weight_a"],
                           a["decoder.layers.1.self_attention.linear_qkv.lora.weight_a"])


def test_freeze_by_pattern_and_config_errors(megatron_cpu_world):
    model = _model(megatron_cpu_world)
    frozen = freeze_parameters([model], ["embedding.*", "decoder.layers.0.*"], "run.yaml")
    names = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == len(names) == 1 + 6  # embedding + layer 0's six weights (2 norms, qkv, proj, fc1, fc2)
    assert all(n.startswith(("embedding.", "decoder.layers.0.")) for n in names)
    with pytest.raises(ConfigError, match="run.yaml: model.freeze pattern 'decoder.layer.*' matches no parameter"):
        freeze_parameters([model], ["decoder.layer.*"], "run.yaml")
    with pytest.raises(ConfigError, match="targets must be null .* or module names of linear layers"):
        check_lora_settings(LoRAConfig(targets=["q proj"]), "run.yaml")
    with pytest.raises(ConfigError, match="^model.lora.targets: q_proj name no linear layer of this model; its "
                                          "tensor-parallel linears: linear_fc1, linear_fc2, linear_proj, linear_qkv$"):
        apply_lora([_model(megatron_cpu_world)], LoRAConfig(targets=["linear_qkv", "q_proj"]), seed=1)
    with pytest.raises(ConfigError, match="rank must be >= 1"):
        check_lora_settings(LoRAConfig(rank=0), "run.yaml")
    with pytest.raises(ConfigError, match=r"model.lora.base_dtype must be bf16 \(or null"):
        check_lora_settings(LoRAConfig(base_dtype="fp16"), "run.yaml")
    check_lora_settings(LoRAConfig(base_dtype="bf16"), "run.yaml", megatron_cpu_world)  # the CPU computes in bf16
    with pytest.raises(ConfigError, match="^run.yaml: model.lora.base_dtype bf16 needs a device that computes in bf16; "
                                          "device 'no-bf16' does not$"):
        check_lora_settings(LoRAConfig(base_dtype="bf16"), "run.yaml", NoBF16Backend())
    config = load_config(None, ["model.freeze=['*']"])
    with pytest.raises(ConfigError, match="leave no parameter to train"):
        apply_adapters([_model(megatron_cpu_world)], config)


def test_lora_config_section_is_typed_and_strict():
    config = load_config(None, ["model.lora.rank=4", "model.lora.targets=[linear_fc1]", "model.freeze=embedding.*"])
    assert config.model.lora == LoRAConfig(rank=4, alpha=16.0, dropout=0.0, targets=["linear_fc1"])
    assert config.model.freeze == ["embedding.*"]
    assert load_config(None, []).model.lora is None
    with pytest.raises(ConfigError, match="unknown key 'model.lora.rnak'"):
        load_config(None, ["model.lora.rnak=4"])
