"""The CPU backend's contract, the CPU torch view megatron modules see, and the CPU layer modules."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from loongforge.devices.base import FEATURES  # noqa: E402
from loongforge.devices.cpu import CPUBackend  # noqa: E402


def test_light_imports_do_not_pull_in_torch():
    code = (
        "import sys, loongforge.devices, loongforge.devices.cpu, loongforge.devices.selection, "
        "loongforge.devices.megatron_cpu, loongforge.models, loongforge.models.registration\n"
        "from loongforge.devices.cpu import CPUBackend\n"
        "assert CPUBackend().probe()[0]\n"
        "heavy = sorted(m for m in ('torch', 'megatron') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_backend_contract():
    backend = CPUBackend()
    assert (backend.name, backend.priority, backend.device_type, backend.dist_backend) == ("cpu", 0, "cpu", "gloo")
    available, why = backend.probe()
    assert available and "CPU" in why
    assert backend.device(3) == torch.device("cpu")
    assert {f: backend.supports(f) for f in FEATURES} == {
        "bf16": True, "fp16": False, "fp8": False, "te": False, "flash_attn": False, "cuda_graphs": False,
        "sequence_parallel": True, "streams": False,
    }
    with pytest.raises(ValueError, match="unknown device feature 'fp4'"):
        backend.supports("fp4")


def test_cpu_rng_state_round_trip_is_bit_exact():
    backend = CPUBackend()
    backend.manual_seed(7)
    state = backend.get_rng_state()
    first = torch.rand(5)
    torch.rand(3)
    backend.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    backend.manual_seed(7)
    assert torch.equal(torch.rand(5), first)


def test_cpu_memory_stats_report_resident_bytes():
    stats = CPUBackend().memory_stats()
    assert stats["allocated"] == stats["rss"] > 10 * 2**20  # a Python process with torch: tens of MiB
    assert stats["peak_allocated"] >= stats["rss"]


def test_streams_events_and_profiler_ranges_are_usable_no_ops():
    backend = CPUBackend()
    stream, event = backend.stream(), backend.event()
    with stream:
        value = torch.ones(2) * 3
    stream.wait_stream(stream)
    event.record()
    event.wait()
    assert event.query() and value.sum().item() == 6.0
    backend.synchronize()
    with torch.profiler.profile() as prof, backend.profiler_range("loongforge-test-range"):
        torch.ones(4).sum()
    assert any(e.name == "loongforge-test-range" for e in prof.events())


def test_torch_view_maps_cuda_to_cpu_only_inside_patched_modules():
    from loongforge.devices.megatron_cpu.torch_view import cpu_device, make_torch_cpu_view

    view = make_torch_cpu_view()
    assert [cpu_device(d) for d in ("cuda", "cuda:1", torch.device("cuda", 0), 0, "cpu", None)] == [
        "cpu", "cpu", "cpu", "cpu", "cpu", None]
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.tensor([1.0], device=view.cuda.current_device()).device.type == "cpu"
    assert view.empty(3, device="cuda", pin_memory=True).is_pinned() is False
    assert view.cuda.is_available() is False and view.cuda.device_count() == 1
    with view.cuda.stream(view.cuda.Stream()):
        view.cuda.synchronize()
    assert view.autocast("cuda", dtype=torch.bfloat16).device == "cpu"
    assert view.matmul is torch.matmul and view.Tensor is torch.Tensor  # untouched names are torch's own


def test_apply_patches_is_idempotent_and_rebinds_megatron_modules():
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.utils as mutils
    from loongforge.devices.megatron_cpu.modules import CUDA_ASSUMING_MODULES
    from loongforge.devices.megatron_cpu.torch_view import TorchCpuView

    backend = CPUBackend()
    backend.apply_patches()
    view = mutils.torch
    backend.apply_patches()
    assert isinstance(view, TorchCpuView) and mutils.torch is view and mappings.torch is view
    assert "megatron.core.pipeline_parallel.schedules" in CUDA_ASSUMING_MODULES
    buffer = mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)


def test_optimizer_type_names_are_scoped_to_construction():
    from loongforge.devices.megatron_cpu.optimizer import cuda_type_names

    x = torch.zeros(1, dtype=torch.bfloat16)
    with cuda_type_names():
        assert x.type() == "torch.cuda.BFloat16Tensor" and torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert x.type(torch.float32).dtype == torch.float32  # conversion calls are untouched
    assert x.type() == "torch.BFloat16Tensor"


def test_clip_grad_by_total_norm_scales_in_place():
    from loongforge.devices.megatron_cpu.optimizer import clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0])
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    coeff = 1.0 / (5.0 + 1e-6)
    assert torch.allclose(params[0].grad, torch.tensor([3.0 * coeff, 0.0, 0.0]))
    assert torch.allclose(params[1].grad, torch.tensor([0.0, 4.0 * coeff]))
    clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=1.0)  # below the limit: unchanged
    assert torch.allclose(params[1].grad, torch.tensor([0.0, 4.0 * coeff]))


def test_rng_tracker_forks_cpu_generator_states(megatron_cpu_world):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    torch.manual_seed(0)
    default_draw = torch.rand(4)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tracker.fork():
            forked = torch.rand(4)
        with tracker.fork():
            forked_again = torch.rand(4)
    assert torch.equal(torch.rand(4), default_draw)  # the default stream is untouched by forks
    assert not torch.equal(forked, default_draw) and not torch.equal(forked, forked_again)
    states = tracker.get_states()
    assert set(states) >= {"model-parallel-rng", "data-parallel-rng"}


def _attention_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)
    return TransformerConfig(**{**base, **kw})


def test_sdpa_attention_matches_megatron_dot_product_attention(megatron_cpu_world):
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = _attention_config()
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, reference = SDPAttention(**args), DotProductAttention(**args)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 3, 4, 16, generator=gen, requires_grad=True)  # [s, b, heads, d]
    k = torch.randn(12, 3, 2, 16, generator=gen, requires_grad=True)  # [s, b, groups, d]
    v = torch.randn(12, 3, 2, 16, generator=gen, requires_grad=True)
    out = ours(q, k, v, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = reference(q, k, v, None)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert out.shape == (12, 3, 64)
    assert (out - expected).abs().max().item() < 1e-5
    for g, e in zip(grads, expected_grads, strict=True):
        assert (g - e).abs().max().item() < 1e-4
    # An explicit padding mask (True = masked out, megatron's convention) is honoured the same way.
    mask = torch.zeros(3, 1, 12, 12, dtype=torch.bool)
    mask[..., 9:] = True
    mask = mask | ~torch.ones(12, 12, dtype=torch.bool).tril()
    assert (ours(q, k, v, mask) - reference(q, k, v, mask)).abs().max().item() < 1e-5


def test_sp_norm_matches_torch_rmsnorm_and_tags_params_for_sequence_parallel(megatron_cpu_world):
    from loongforge.devices.norm import SPNorm

    norm = SPNorm(_attention_config(normalization="RMSNorm"), hidden_size=64, eps=1e-6)
    reference = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(norm.weight)
    x = torch.randn(5, 2, 64)
    assert (norm(x) - reference(x)).abs().max().item() < 1e-6
    assert norm.weight.sequence_parallel is False
    sp_config = _attention_config(normalization="RMSNorm", tensor_model_parallel_size=2, sequence_parallel=True)
    assert SPNorm(sp_config, hidden_size=64).weight.sequence_parallel is True
    layer_norm = SPNorm(_attention_config(normalization="LayerNorm"), hidden_size=64)
    assert torch.allclose(layer_norm(x), torch.nn.functional.layer_norm(x, (64,)), atol=1e-6)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_sp_rmsnorm_gradients_match_torch_rmsnorm(megatron_cpu_world, zero_centered):
    """The analytic backward (RMSNormFunction) against autograd through torch's RMSNorm: forward bitwise (the same
    fused kernel), input and weight gradients to float rounding, for a strided input (a q/k-norm over heads)."""
    from loongforge.devices.norm import RMSNormFunction, SPNorm

    norm = SPNorm(_attention_config(normalization="RMSNorm", layernorm_zero_centered_gamma=zero_centered),
                  hidden_size=16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    reference = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(norm.weight + 1 if zero_centered else norm.weight)
    base = torch.randn(7, 3, 4, 40) * 2
    x1, x2 = (base[..., 8:24].clone().requires_grad_() for _ in range(2))
    out, ref = norm(x1), reference(x2)
    assert torch.equal(out, ref)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    x64 = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), (x64, w64))
