"""The ``adaptive-fp8`` optimization: registration, options, config checks, the one-line refusals where FP8
cannot run, and the per-module BF16 wrapping."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from loongforge.config import load_config
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_cuda.fp8.optimization import AdaptiveFP8Optimization, keep_in_bf16, why_not_fp8
from loongforge_cuda.fp8.policy import ModulePolicy, Policy, PolicyError, save_policy


def _policy(emulated: bool = False, recipe: str = "blockwise") -> Policy:
    modules = {"mlp.linear_fc1": ModulePolicy(64, 352, 1024), "mlp.linear_fc2": ModulePolicy(176, 64, None)}
    return Policy(modules, device="NVIDIA H100", recipe=recipe, emulated=emulated, source="p.json")


def _config(*overrides: str):
    return load_config(None, ["model.name=llama-debug", "training.micro_batch_size=2", "data.seq_length=512",
                              *overrides])


@pytest.mark.needs_plugins
def test_registered_by_the_cuda_plugin():
    from loongforge.plugins import PluginHost

    entry = PluginHost().registry("optimization").entry("adaptive-fp8")
    assert entry.provider == "loongforge-cuda"
    assert entry.load() is AdaptiveFP8Optimization


def test_options_are_checked():
    with pytest.raises(ConfigError, match=r"optimizations\.adaptive-fp8: policy is required"):
        AdaptiveFP8Optimization({})
    with pytest.raises(ConfigError, match=r"unknown key 'optimizations\.adaptive-fp8\.polcy' \(known keys here: "
                                          r"policy, tokens_per_microbatch\); did you mean 'policy'"):
        AdaptiveFP8Optimization({"polcy": "x.json"})


def test_configure_needs_fp8_precision(tmp_path):
    opt = AdaptiveFP8Optimization({"policy": str(tmp_path / "p.json")})
    with pytest.raises(ConfigError, match=r"adaptive-fp8 in <defaults> needs training\.precision: fp8 .* got bf16"):
        opt.loongforge_configure(_config("training.precision=bf16"))
    with pytest.raises(PolicyError, match=r"p\.json: FP8 policy file not found"):
        opt.loongforge_configure(_config("training.precision=fp8"))


def test_configure_loads_the_policy_and_checks_the_recipe(tmp_path):
    path = save_policy(_policy(), tmp_path / "p.json")
    opt = AdaptiveFP8Optimization({"policy": str(path)})
    opt.loongforge_configure(_config("training.precision=fp8"))
    assert opt.tokens == 1024 and opt.policy.modules["mlp.linear_fc1"].fp8_from_tokens == 1024
    opt.loongforge_configure(_config("training.precision=fp8", "device_options.fp8_recipe=blockwise"))
    with pytest.raises(ConfigError, match=r"measured with fp8_recipe 'blockwise' but device_options\.fp8_recipe "
                                          r"is 'tensorwise'"):
        opt.loongforge_configure(_config("training.precision=fp8", "device_options.fp8_recipe=tensorwise"))
    with pytest.raises(ConfigError, match=r"device_options\.fp8_param keeps weights in FP8"):
        opt.loongforge_configure(_config("training.precision=fp8", "device_options.fp8_param=true"))
    pinned = AdaptiveFP8Optimization({"policy": str(path), "tokens_per_microbatch": 4096})
    pinned.loongforge_configure(_config("training.precision=fp8"))
    assert pinned.tokens == 4096


@pytest.mark.needs_plugins
@pytest.mark.parametrize(("precision", "message"), [
    ("bf16", "adaptive-fp8 in <defaults> needs training.precision: fp8"),
    ("fp8", "training.precision / device_options: device 'cpu' does not support precision 'fp8'"),
])
def test_training_on_cpu_with_adaptive_fp8_stops_with_the_reason(tmp_path, precision, message):
    """Enabled from a config, it never trains quietly without FP8: bf16 runs are refused by the optimization,
    fp8 runs on the CPU by the device, both before any model exists."""
    from loongforge.train.run import run_training

    path = save_policy(_policy(), tmp_path / "p.json")
    config = _config(f"training.precision={precision}", f"optimizations.adaptive-fp8.policy={path}",
                     f"run.output_dir={tmp_path / 'out'}", "training.threads=1")
    with pytest.raises(ConfigError, match=message):
        run_training(config, device="cpu")
    assert not (tmp_path / "out" / "checkpoints").exists()


class _FakeTELinear:
    """Stands for a TE linear module in :func:`why_not_fp8` (only its class and parameters' device matter)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def parameters(self):
        return [SimpleNamespace(device=SimpleNamespace(type=self.device))]


def test_why_not_fp8_names_each_missing_piece():
    gpu = {"decoder.layers.0.mlp.linear_fc1": _FakeTELinear("cuda")}
    assert "the model has no GEMM modules" in why_not_fp8({}, _policy())
    assert why_not_fp8({"l": _FakeTELinear("cpu")}, _policy(), (_FakeTELinear,)) == (
        "adaptive-fp8 needs an NVIDIA GPU with FP8 (Transformer Engine); the model's GEMMs are on cpu")
    assert "needs Transformer Engine layers (pip install 'loongforge-cuda[te]'); decoder.layers.0.mlp.linear_fc1 " \
           "is megatron's local layer" in why_not_fp8(gpu, _policy(), ())
    assert "p.json was measured in CPU emulation (key emulated: true)" in why_not_fp8(
        gpu, _policy(emulated=True), (_FakeTELinear,))
    assert why_not_fp8(gpu, _policy(), (_FakeTELinear,)) is None


def test_modify_model_before_configure_is_an_error():
    with pytest.raises(LoongForgeError, match="loongforge_configure was not called"):
        AdaptiveFP8Optimization({"policy": "p.json"}).loongforge_modify_model([torch.nn.Linear(2, 2)], None)


def test_keep_in_bf16_wraps_only_the_bf16_modules():
    entered: list[str] = []

    @contextlib.contextmanager
    def recording_context():
        entered.append("enter")
        yield
        entered.append("exit")

    fast, slow = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    calls = []
    fast.register_forward_hook(lambda *_: calls.append("fast hook"))
    wrapped = keep_in_bf16({"fast": fast, "slow": slow}, {"fast": True, "slow": False}, recording_context)
    assert wrapped == ["slow"]
    x = torch.randn(3, 4)
    reference = torch.nn.functional.linear(x, slow.weight, slow.bias)
    assert torch.equal(slow(x), reference) and entered == ["enter", "exit"]
    fast(x)
    assert entered == ["enter", "exit"] and calls == ["fast hook"]
