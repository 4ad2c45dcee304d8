"""The CPU backend's one-rank tensor-parallel crossings (:mod:`loongforge.devices.megatron_cpu.tp_regions`) and
what they are for: on a one-rank group megatron's column/row-parallel layers cross no autograd Function, so that
their compiled graph is one AOTAutograd's cache accepts (a refused graph is re-traced in every new process).
Several ranks keep megatron's crossings; the tp=2 parity tests (test_parallel_parity.py) train through them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loongforge.devices.cpu import CPUBackend
from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches, gemm
from loongforge.devices.megatron_cpu.tp_regions import CROSSINGS
from loongforge.testing.one_step import one_process_world
from megatron.core.tensor_parallel import layers, mappings
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

apply_megatron_cpu_patches()


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv(gemm.GEMM_VARIABLE, "onednn")
    gemm.linear_kernel.cache_clear()
    with one_process_world(CPUBackend(), tmp_path):
        yield
    gemm.linear_kernel.cache_clear()


def test_the_crossings_are_replaced_where_the_layers_look_them_up() -> None:
    for name in CROSSINGS:
        replacement = getattr(layers, name)
        assert replacement.megatron_original is getattr(mappings, name)
    apply_megatron_cpu_patches()  # idempotent: megatron's function stays the one underneath
    assert all(getattr(layers, name).megatron_original is getattr(mappings, name) for name in CROSSINGS)


def test_on_one_rank_a_crossing_is_the_input_itself(world) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    for name in CROSSINGS:
        assert getattr(layers, name)(x) is x
        assert getattr(mappings, name)(x) is not x  # megatron's own: an autograd node in between


def _layer_pair():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    torch.manual_seed(3)
    column = layers.ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.normal_, bias=True,
                                         gather_output=False)
    row = layers.RowParallelLinear(64, 32, config=config, init_method=torch.nn.init.normal_, bias=True,
                                   input_is_parallel=True, skip_bias_add=False)
    return column, row


def test_compiled_megatron_linears_are_cacheable_and_train_to_the_eager_gradients(world) -> None:
    column, row = _layer_pair()
    refusals: list[str] = []
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        try:
            check_cacheable(graph)
        except BypassAOTAutogradCache as refused:
            refusals.append(str(refused))
        return graph.forward

    def loss(x):
        hidden, _ = column(x)
        out, _ = row(F.silu(hidden))
        return out.square().sum()

    x = torch.randn(8, 2, 32, requires_grad=True)
    compiled = torch.compile(loss, backend=backend, fullgraph=True)(x)
    compiled.backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in (*column.parameters(), *row.parameters()))]
    for tensor in (x, *column.parameters(), *row.parameters()):
        tensor.grad = None
    eager = loss(x)
    eager.backward()
    assert len(graphs) == 1 and refusals == []
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("onednn_linear" in target for target in targets) == 2, targets
    torch.testing.assert_close(compiled, eager)
    for ours, theirs in zip(grads, [x.grad, *(p.grad for p in (*column.parameters(), *row.parameters()))],
                            strict=True):
        torch.testing.assert_close(ours, theirs)
