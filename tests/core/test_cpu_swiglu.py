"""The CPU backend's SwiGLU (:mod:`loongforge.devices.megatron_cpu.swiglu`) against megatron's unfused MLP.

A dense SwiGLU flavor routes its MLP through megatron's fused entry point (``bias_activation_fusion``), and on CPU
that is :class:`SwiGLUHalves`: its output and input gradient must be bitwise megatron's unfused ``glu`` (the same
kernels), with and without a fc1 bias, for a strided input; it must save only its input for backward; the cases it
does not cover must reach megatron's function; and a whole MLP layer must match the unfused one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches
from loongforge.devices.megatron_cpu.swiglu import SWIGLU_CALLERS, SwiGLUHalves, eager_bias_swiglu
from megatron.core.transformer import mlp as megatron_mlp

apply_megatron_cpu_patches()
MEGATRON = megatron_mlp.bias_swiglu_impl.megatron_original


def _unfused(x: torch.Tensor) -> torch.Tensor:
    """megatron's MLP without the fusion: ``activation(gate) * (up + glu_linear_offset)``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


def _output_and_grad(fn, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(upstream)
    return out.detach(), leaf.grad


def test_the_patch_is_installed_where_megatrons_mlps_look_it_up() -> None:
    import importlib

    for name in SWIGLU_CALLERS:
        impl = importlib.import_module(name).bias_swiglu_impl
        assert impl.megatron_original is MEGATRON
    apply_megatron_cpu_patches()  # idempotent: still one layer of wrapping
    assert megatron_mlp.bias_swiglu_impl.megatron_original is MEGATRON


@pytest.mark.parametrize("shape", [(7, 3, 2 * 24), (5, 2 * 9)])
def test_bitwise_megatrons_unfused_glu(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    upstream = torch.randn(*shape[:-1], shape[-1] // 2)
    ours, grad_ours = _output_and_grad(lambda t: megatron_mlp.bias_swiglu_impl(t, None), x, upstream)
    ref, grad_ref = _output_and_grad(_unfused, x, upstream)
    assert torch.equal(ours, ref)
    assert torch.equal(grad_ours, grad_ref)


def test_bias_is_added_before_the_activation_and_gets_its_gradient() -> None:
    torch.manual_seed(1)
    x, bias = torch.randn(6, 2, 16), torch.randn(16)
    upstream = torch.randn(6, 2, 8)
    b1, b2 = bias.clone().requires_grad_(), bias.clone().requires_grad_()
    ours, grad_ours = _output_and_grad(lambda t: megatron_mlp.bias_swiglu_impl(t, b1), x, upstream)
    ref, grad_ref = _output_and_grad(lambda t: _unfused(t + b2), x, upstream)
    assert torch.equal(ours, ref) and torch.equal(grad_ours, grad_ref)
    assert torch.equal(b1.grad, b2.grad)


def test_strided_input_and_gradient_in_double() -> None:
    torch.manual_seed(2)
    wide = torch.randn(4, 3, 40, dtype=torch.float64)
    x = wide[..., 4:36].requires_grad_()  # not contiguous
    assert torch.autograd.gradcheck(SwiGLUHalves.apply, (x,))


def test_only_the_input_is_kept_for_backward() -> None:
    x = torch.randn(8, 2, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SwiGLUHalves.apply(x)
    assert len(saved) == 1 and saved[0] is x
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _unfused(x)
    assert len(saved) == 3  # gate (for silu), silu(gate) and the offset copy of up (for the product)


def test_uncovered_arguments_go_to_megatrons_function() -> None:
    calls: list[tuple] = []

    def recording(*args):
        calls.append(args)
        return args[0]

    impl = eager_bias_swiglu(recording)
    x = torch.randn(3, 8)
    assert impl(x, None, True) is x  # FP8 input store
    assert impl(x, None, False, True) is x  # CPU offload of the input
    assert len(calls) == 2
    impl(x, None)
    assert len(calls) == 2


def test_a_dense_swiglu_mlp_layer_matches_the_unfused_layer(tmp_path) -> None:
    """megatron's MLP built with ``bias_activation_fusion`` (what core's builder sets for dense SwiGLU) against
    the same weights without it: bitwise outputs and weight gradients."""
    from loongforge.devices.cpu import CPUBackend
    from loongforge.devices.cpu_spec import CPUSpecProvider
    from loongforge.testing.one_step import one_process_world
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    with one_process_world(CPUBackend(), tmp_path):
        provider = CPUSpecProvider()
        submodules = MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                   linear_fc2=provider.row_parallel_linear())
        grads, outputs = [], []
        x = torch.randn(10, 2, 32)
        for fused in (True, False):
            config = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                                       gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                                       bias_activation_fusion=fused, use_cpu_initialization=True)
            torch.manual_seed(3)
            layer = MLP(config, submodules, ffn_hidden_size=48)
            out, _ = layer(x)
            out.square().sum().backward()
            outputs.append(out.detach())
            grads.append([p.grad for p in layer.parameters()])
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
