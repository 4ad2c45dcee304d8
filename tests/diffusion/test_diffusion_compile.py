"""``training.compile`` on the task engine: a Wan DiT whose blocks are compiled (``regional``) trains the same
steps as in eager mode, with one compiled graph for all blocks, and reports what compiling cost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongforge.tasks import TaskBase
from loongforge.testing.runs import step_losses, train
from loongforge_diffusion.wan.rope import apply_rope, rope_table

pytestmark = [pytest.mark.needs_plugins]

ROOT = Path(__file__).resolve().parents[2]
#: Two blocks of width 32 (4x6x6 tokens), three steps, one sampled video (after training, run eagerly).
SMALL = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "training.steps=3",
         "training.micro_batch_size=4", "checkpoint.interval=0", "checkpoint.save_at_end=false",
         "task.samples=32", "task.sample={videos: 1, steps: 2}",
         "model.overrides={dim: 32, ffn_dim: 64, num_heads: 2, num_layers: 2, patch_size: [1, 2, 2]}"]


def _run(tmp_path: Path, name: str, *overrides: str) -> dict:
    return train(ROOT / "configs/diffusion-moving-squares.yaml", tmp_path / name, [*SMALL, *overrides])


@pytest.mark.slow
def test_regional_compile_trains_the_same_steps_as_eager(tmp_path, capsys):
    eager = _run(tmp_path, "eager", "logging.interval=1")
    compiled = _run(tmp_path, "regional", "logging.interval=1", "training.compile=regional")
    assert eager["compile"] == "off"
    # the eager run counted one micro-batch's saved activations by component: the DiT blocks hold most of them
    activations = eager["activation_mib"]
    assert max(activations, key=activations.get) == "blocks" and activations["blocks"] > 0.5 * sum(activations.values())
    assert compiled["activation_mib"] == {}  # not counted under compile
    assert compiled["compile"] == "regional" and compiled["compiled_modules"] == {"WanBlock": 2}
    # both blocks share one graph (a second would mean a recompile per block), and the video sampled after training
    # (batch 1, no gradients) ran eagerly instead of compiling another
    assert compiled["compile_graphs"] == 1 and compiled["compile_s"] > 0
    assert "training.compile regional: 2 WanBlock compiled in" in capsys.readouterr().out
    ours, reference = step_losses(tmp_path / "regional"), step_losses(tmp_path / "eager")
    assert len(ours) == len(reference) == 3
    # the same weights, data and noise; only the kernels' float rounding differs (fused, reordered reductions)
    assert ours == pytest.approx(reference, rel=1e-4, abs=1e-6)


def test_repeated_blocks_are_the_outermost_module_list_members():
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(2, 2)
            self.layers = torch.nn.ModuleList([Layer(), Layer(), Layer()])
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    model = Model()
    blocks = TaskBase().repeated_blocks(model)
    # the experts inside a layer are not blocks of their own; a second top-level list is
    assert blocks == [*model.layers, *model.heads]


def test_rope_rotation_is_the_same_eagerly_and_under_compile():
    table = rope_table(12, (2, 3, 4), 10000.0, torch.device("cpu"))
    x = torch.randn(2, 24, 3, 12)
    eager = apply_rope(x, table)
    compiled = torch.compile(apply_rope, backend="aot_eager", fullgraph=True)(x, table)  # the cos/sin branch
    assert table.shape == (24, 6, 2) and table.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    # rotations keep each pair's length
    torch.testing.assert_close(eager.unflatten(-1, (-1, 2)).norm(dim=-1), x.unflatten(-1, (-1, 2)).norm(dim=-1))


def _compiled_targets(function, *inputs):
    """The ops in the graph ``torch.compile`` traces for ``function(*inputs)``, and its output."""
    targets: list[str] = []

    def record(graph_module, _example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    return targets, torch.compile(function, backend=record, fullgraph=True)(*inputs)


@pytest.mark.parametrize(("keys", "explicit"), [(8, True), (16, True), (17, False)])
def test_compiled_attention_writes_out_short_contexts_and_keeps_sdpa_for_long_ones(keys, explicit):
    from loongforge_diffusion.wan.attention import attend

    q, k, v = torch.randn(2, 24, 3, 16), torch.randn(2, keys, 3, 16), torch.randn(2, keys, 3, 16)
    targets, compiled = _compiled_targets(attend, q, k, v)
    # keys no longer than the head dim (16) are attended with the written-out softmax, which Inductor fuses
    assert any("scaled_dot_product_attention" in target for target in targets) is not explicit
    assert any("softmax" in target for target in targets) is explicit
    # either way the numbers are SDPA's, in the (B, S, H*D) layout
    reference = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2)).transpose(1, 2).flatten(2)
    assert compiled.shape == (2, 24, 48)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attend(q, k, v), reference, rtol=0, atol=0)  # eagerly: SDPA itself
