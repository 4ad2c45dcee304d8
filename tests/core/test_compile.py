"""``training.compile``: regional compilation of the repeated blocks, in place, one graph for all of them.

The helper (:func:`loongforge.train.compile.compile_blocks`) on a small stack of identical blocks: the compiled
stack computes what the eager one does (outputs and gradients), dynamo compiles one frame for all blocks, the
modules keep their ``state_dict`` keys, and the report counts what was compiled and how long it took. Then the
megatron engine end to end: ``training.compile: regional`` trains the same losses and gradient norms as eager for
3 steps of ``llama-debug`` (fp32; within 1e-5 relative: inductor may reorder floating-point sums), with every
transformer layer compiled and the compiled frames bounded (one per kind of layer plus at most a few for the
backward), and the same at tp=2 with full activation recompute under torchrun (gloo), against the one-process
eager run.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge.errors import ConfigError
from loongforge.train.compile import compile_blocks
from torch import nn

#: Relative tolerance between compiled and eager losses / gradient norms (fp32).
RTOL = 1e-5


class Block(nn.Module):
    """A residual MLP block: what a transformer layer looks like to dynamo, at a tiny size."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    """The output projection after the blocks (what ``rest`` holds in ``True`` mode)."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts without graphs compiled by another one, so graph counts are this test's."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _stack(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


@pytest.mark.slow
def test_regional_compile_is_one_graph_for_identical_blocks_and_computes_what_eager_does():
    torch.manual_seed(0)
    eager = nn.ModuleList(Block(32) for _ in range(3))
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 8, 32, requires_grad=True)  # as a decoder's layers get the embedding's output

    report = compile_blocks(compiled, "regional")
    assert report.summary()["compiled_modules"] == {"Block": 3}
    out = _stack(compiled, x)
    out.square().mean().backward()
    reference = _stack(eager, x)
    reference.square().mean().backward()

    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    summary = report.summary()
    assert summary["compile"] == "regional"
    assert summary["compile_graphs"] == 1  # parameters are graph inputs: one compilation serves all three
    assert summary["compile_s"] > 0
    assert list(compiled.state_dict()) == list(eager.state_dict())  # in place: no ``_orig_mod.`` prefix

    _stack(compiled, x)  # a second call reuses the graph
    assert report.graphs() == 1


@pytest.mark.slow
def test_true_also_compiles_the_rest_and_false_compiles_nothing():
    blocks = nn.ModuleList(Block(16) for _ in range(2))
    head = Head(16, 4)
    assert compile_blocks(blocks, False, rest=[head]).summary() == {"compile": "off"}
    x = torch.randn(2, 16, requires_grad=True)
    off = compile_blocks(blocks, False)
    head(_stack(blocks, x)).sum().backward()
    assert off.graphs() == 0 and off.compile_s() == 0.0

    eager_blocks, eager_head = copy.deepcopy(blocks), copy.deepcopy(head)
    full = compile_blocks(blocks, True, rest=[head])
    assert full.summary()["compiled_modules"] == {"Block": 2, "Head": 1}
    assert full.summary()["compile"] == "full"
    torch.testing.assert_close(head(_stack(blocks, x)), eager_head(_stack(eager_blocks, x)), rtol=1e-5, atol=1e-6)
    assert full.graphs() == 2  # one for the blocks, one for the head


@pytest.mark.parametrize("mode", ["yes", "whole", 1])
def test_an_unknown_mode_is_refused_in_one_line(mode):
    with pytest.raises(ConfigError, match="training.compile must be false, true or regional"):
        compile_blocks([Block(8)], mode)


# -- the megatron engine -----------------------------------------------------------------------------------

CONFIG = """
run: {output_dir: OUT, seed: 5}
model: {name: llama-debug, overrides: {num_layers: 4}}
data: {seq_length: 32}
optimizer: {lr: 0.002, grad_clip: 1.0}
scheduler: {warmup_steps: 1}
training: {steps: 3, micro_batch_size: 4, threads: 1}
checkpoint: {save_at_end: false, resume: never, keep_last: 0}
logging: {interval: 1, progress: false, tensorboard: false}
"""


def _rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _assert_same_training(rows: dict[int, dict], reference: dict[int, dict]) -> None:
    assert sorted(rows) == sorted(reference) == [1, 2, 3]
    for step, row in rows.items():
        for key in ("loss", "grad_norm"):
            assert row[key] == pytest.approx(reference[step][key], rel=RTOL), (step, key)


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_regional_compile_trains_the_eager_losses_at_tp1_and_at_tp2_with_recompute(tmp_path):
    from loongforge.config import load_config
    from loongforge.train.run import run_training

    def train(name: str, *overrides: str) -> tuple[dict, dict]:
        out = tmp_path / name
        path = tmp_path / f"{name}.yaml"
        path.write_text(CONFIG.replace("OUT", str(out)))
        summary = run_training(load_config(str(path), list(overrides)), device="cpu")
        return summary, _rows(out)

    eager_summary, eager = train("eager")
    assert eager_summary["compile"] == "off"
    memory = eager_summary["memory_mib"]  # fp32: DDP's gradient buffer matches the weights, Adam keeps two moments
    assert memory["parameters"] > 0 and memory["gradients"] == memory["parameters"]
    # two moments per weight, plus one 4-byte step count per tensor; each figure is rounded to 0.01 MiB
    assert memory["optimizer_state"] == pytest.approx(2 * memory["parameters"], abs=0.02)
    assert memory["main_params"] == 0.0 and memory["peak"] > memory["parameters"]
    # the first step's saved activations, by component: the four layers hold almost all of them
    activations = eager_summary["activation_mib"]
    assert set(activations) == {"embedding", "decoder", "output_layer", "rest"}
    assert memory["activations"] == pytest.approx(sum(activations.values()), abs=0.02)
    assert activations["decoder"] > 0.9 * memory["activations"] > 0
    summary, compiled = train("regional", "training.compile=regional")
    # not counted under compile (the counting hooks would be guarded on and the blocks compiled twice)
    assert "activations" not in summary["memory_mib"] and summary["activation_mib"] == {}
    _assert_same_training(compiled, eager)
    assert summary["compile"] == "regional"
    assert summary["compiled_modules"] == {"TransformerLayer": 4}
    assert summary["compile_s"] > 0
    # One forward frame for the four identical layers; a recompile per layer would show 4 or more.
    assert 1 <= summary["compile_graphs"] <= 2

    out = tmp_path / "tp2"
    path = tmp_path / "tp2.yaml"
    path.write_text(CONFIG.replace("OUT", str(out)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "loongforge.cli", "train", str(path), "parallel.tp=2", "training.compile=regional",
               "model.recompute.granularity=full"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    _assert_same_training(_rows(out), eager)
