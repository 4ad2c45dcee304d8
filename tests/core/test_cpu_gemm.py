"""The CPU backend's oneDNN linear layers (:mod:`loongforge.devices.megatron_cpu.gemm`).

:class:`OneDNNLinear` must compute ``x @ W^T + b`` and its three gradients (checked against float64), for a
strided 3-D input; megatron's parallel linear layers must route through it exactly in the cases it covers and
reach megatron's own function in every other; the library choice must follow ``LOONGFORGE_CPU_GEMM`` and the
processor's vendor, and a bad value must be an error naming the variable.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches, gemm, gemm_choice
from loongforge.devices.megatron_cpu.gemm import OneDNNLinear, onednn_linear, onednn_linear_op
from megatron.core.tensor_parallel import layers

apply_megatron_cpu_patches()
MEGATRON = layers.linear_with_grad_accumulation_and_async_allreduce.megatron_original
#: The grad_fn of the covered case's output (the operator's registered backward).
OPERATOR_BACKWARD = "GeneratedBackwardFor_loongforge_onednn_linear_defaultBackward"


@pytest.fixture
def kernel(monkeypatch):
    """Set LOONGFORGE_CPU_GEMM for one test (the choice is cached per process)."""

    def choose(value: str) -> None:
        monkeypatch.setenv(gemm.GEMM_VARIABLE, value)
        gemm.linear_kernel.cache_clear()

    yield choose
    gemm.linear_kernel.cache_clear()


def test_the_patch_is_installed_where_megatrons_linears_look_it_up() -> None:
    assert layers.linear_with_grad_accumulation_and_async_allreduce is not MEGATRON
    apply_megatron_cpu_patches()
    assert layers.linear_with_grad_accumulation_and_async_allreduce.megatron_original is MEGATRON


def _all_reduced(x, weight, bias):
    """:class:`OneDNNLinear` over a one-rank gloo group (the all-reduce runs, and sums one contribution)."""
    import torch.distributed as dist

    return OneDNNLinear.apply(x, weight, bias, dist.new_group([0], backend="gloo"))


@pytest.fixture
def gloo_world(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("function", [onednn_linear_op, _all_reduced], ids=["operator", "all-reduced"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_against_float64(with_bias: bool, function, gloo_world) -> None:
    torch.manual_seed(0)
    wide = torch.randn(12, 3, 40)
    x = wide[..., 4:36].clone().transpose(0, 1).requires_grad_()  # [3, 12, 32], not contiguous
    weight = torch.randn(24, 32, requires_grad=True)
    bias = torch.randn(24, requires_grad=True) if with_bias else None
    out = function(x, weight, bias)
    assert out._base is None  # not a view: in-place ops downstream keep the custom backward
    upstream = torch.randn_like(out)
    out.backward(upstream)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if with_bias else None
    ref = F.linear(x64, w64, b64)
    ref.backward(upstream.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    if with_bias:
        torch.testing.assert_close(bias.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


def _recording():
    calls: list[tuple] = []

    def original(*args):
        calls.append(args)
        return torch.zeros(())

    return calls, onednn_linear(original)


@pytest.mark.parametrize(("case", "change"), [
    ("sequence parallel", {"sequence_parallel": True}),
    ("fused gradient accumulation", {"gradient_accumulation_fusion": True}),
    ("deferred embedding wgrad", {"grad_output_buffer": []}),
    ("bf16", {"dtype": torch.bfloat16}),
])
def test_uncovered_cases_reach_megatrons_function(kernel, case: str, change: dict) -> None:
    kernel("onednn")
    calls, linear = _recording()
    dtype = change.pop("dtype", torch.float32)
    x, weight = torch.randn(4, 2, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype)
    args = {"gradient_accumulation_fusion": False, "allreduce_dgrad": False, "sequence_parallel": False, **change}
    linear(x, weight, None, **args)
    assert len(calls) == 1, case


def test_covered_case_is_onednn_and_aten_keeps_megatrons_function(kernel) -> None:
    calls, linear = _recording()
    x, weight = torch.randn(4, 2, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    kernel("onednn")
    out = linear(x, weight, None, False, False, False)
    assert not calls and out.grad_fn.name() == OPERATOR_BACKWARD
    kernel("aten")
    linear(x, weight, None, False, False, False)
    assert len(calls) == 1


def test_a_column_parallel_layer_trains_the_same_on_both_libraries(kernel, tmp_path) -> None:
    from loongforge.devices.cpu import CPUBackend
    from loongforge.testing.one_step import one_process_world
    from megatron.core.transformer.transformer_config import TransformerConfig

    results = {}
    with one_process_world(CPUBackend(), tmp_path):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
        x = torch.randn(16, 2, 32)
        for library in ("aten", "onednn"):
            kernel(library)
            torch.manual_seed(1)
            layer = layers.ColumnParallelLinear(32, 48, config=config, init_method=torch.nn.init.normal_, bias=True,
                                                gather_output=False)
            inp = x.clone().requires_grad_()
            out, _ = layer(inp)
            out.square().sum().backward()
            results[library] = (out.detach(), inp.grad, layer.weight.grad, layer.bias.grad,
                                out.grad_fn.name())
    assert results["onednn"][-1] == OPERATOR_BACKWARD and results["aten"][-1] != OPERATOR_BACKWARD
    for ours, theirs in zip(results["onednn"][:-1], results["aten"][:-1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_vendor_rule_and_variable(kernel, tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    assert gemm_choice.cpu_vendor(str(cpuinfo)) == "AuthenticAMD"
    assert gemm_choice.cpu_vendor(str(tmp_path / "absent")) is None
    rule = gemm_choice.automatic_kernel
    assert rule("AuthenticAMD") == "onednn" and rule("HygonGenuine") == "onednn"
    assert rule("GenuineIntel") == "aten" and rule(None) == "aten"
    kernel("aten")
    assert gemm.linear_kernel() == "aten"
    assert gemm_choice.planned_kernel() == "aten (LOONGFORGE_CPU_GEMM=aten)"  # what doctor shows
    kernel("fastest")
    with pytest.raises(ValueError, match="LOONGFORGE_CPU_GEMM='fastest'"):
        gemm.linear_kernel()


def test_compiled_graphs_keep_onednn_as_one_opaque_operator(kernel) -> None:
    """Under torch.compile (training.compile) the covered case traces into the graph as loongforge::onednn_linear,
    without a graph break, and trains to the eager values."""
    kernel("onednn")
    calls, linear = _recording()
    x, weight = torch.randn(16, 2, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    targets: list[str] = []

    def backend(graph, example_inputs):
        for module in graph.modules():  # the autograd.Function's forward/backward are subgraphs
            if isinstance(module, torch.fx.GraphModule):
                targets.extend(str(node.target) for node in module.graph.nodes if node.op == "call_function")
        return graph.forward

    def loss(a, w):
        return F.silu(linear(a, w, None, False, False, False)).square().sum()

    compiled = torch.compile(loss, backend=backend, fullgraph=True)(x, weight)
    compiled.backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    eager = loss(x, weight)
    eager.backward()
    assert not calls
    assert any("onednn_linear" in target for target in targets), targets
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], weight.grad)
