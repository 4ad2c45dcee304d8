"""The planner's choices: published layouts for real sizes, recompute selection, impossible requests, the CLI."""

from __future__ import annotations

import json

import pytest
from loongforge.cli import main
from loongforge.errors import ConfigError
from loongforge.models.registration import all_flavors
from loongforge.planner.hardware import GIB, ClusterSpec
from loongforge.planner.layouts import SearchSpace
from loongforge.planner.memory import Workload, estimate_memory
from loongforge.planner.planner import plan
from loongforge.planner.timing import estimate_time

FLAVORS = all_flavors()


def test_llama3_70b_on_64_gpus_picks_the_nemo_recipe_layout():
    """NeMo's Llama-3 70B pretraining recipe: TP4 PP4 VPP5 CP2, sequence parallel, micro-batch 1, seq 8192."""
    result = plan(Workload(FLAVORS["llama3-70b"], 8192, "bf16"), ClusterSpec(64, 80 * GIB),
                  SearchSpace(global_batch_size=128))
    best = result.best.candidate
    assert (best.tp, best.pp, best.cp, best.dp, best.vpp) == (4, 4, 2, 2, 5)
    assert best.sequence_parallel and best.distributed_optimizer and best.micro_batch_size == 1
    assert result.best.memory.total <= 0.9 * 80 * GIB
    assert json.loads(json.dumps(result.decision()))["parallel"]["tp"] == 4


def test_qwen3_30b_a3b_on_16_gpus_uses_expert_parallelism_with_whole_experts():
    """Megatron's MoE guidance (and Qwen3-MoE recipes): experts over EP, not split by TP (768-wide experts)."""
    result = plan(Workload(FLAVORS["qwen3-30b-a3b"], 4096, "bf16"), ClusterSpec(16, 80 * GIB),
                  SearchSpace(global_batch_size=256))
    best = result.best.candidate
    assert best.ep >= 4 and best.etp == 1
    assert best.tp * best.pp * best.cp * best.dp == 16


def test_qwen2_5_7b_on_8_gpus_needs_no_pipeline():
    result = plan(Workload(FLAVORS["qwen2.5-7b"], 4096, "bf16"), ClusterSpec(8, 80 * GIB),
                  SearchSpace(global_batch_size=64))
    best = result.best.candidate
    assert best.pp == 1 and best.tp <= 2 and best.recompute.granularity == "none"


def test_recompute_is_the_cheapest_that_fits():
    """Roomy memory: no recompute. Tight memory: full recompute of only as many layers as needed (with flash
    attention, selective core_attn frees almost nothing, and re-running whole layers frees more per FLOP
    than re-running only MLPs)."""
    from dataclasses import replace

    from loongforge.planner.layouts import RecomputePlan

    w = Workload(FLAVORS["qwen2.5-7b"], 4096, "bf16")
    space = SearchSpace(global_batch_size=64, micro_batch_size=1, max_cp=1, try_vpp=False)
    assert plan(w, ClusterSpec(8, 80 * GIB), space).best.candidate.recompute.granularity == "none"
    cluster = ClusterSpec(8, 40 * GIB)
    tight = plan(w, cluster, space)
    budget = 0.9 * 40 * GIB
    partial = [ev.candidate for ev in tight.ranked if ev.candidate.recompute.granularity == "full"]
    assert partial
    for cand in partial:
        assert estimate_memory(w, cand).total <= budget
        k = cand.recompute.num_layers
        if k > 1:  # one layer fewer would not fit
            assert estimate_memory(w, replace(cand, recompute=RecomputePlan("full", num_layers=k - 1))).total > budget
        chosen = estimate_time(w, cand, cluster).total
        for modules in (("core_attn",), ("mlp",), ("core_attn", "mlp")):  # selective was weighed: no fit or slower
            selective = replace(cand, recompute=RecomputePlan("selective", modules))
            assert estimate_memory(w, selective).total > budget or estimate_time(w, selective, cluster).total >= chosen


def test_impossible_request_names_smallest_devices_and_memory():
    w = Workload(FLAVORS["llama3-70b"], 8192, "bf16")
    space = SearchSpace(global_batch_size=128)
    result = plan(w, ClusterSpec(8, 80 * GIB), space)
    assert not result.ranked and result.rejected["exceeds memory even with full recompute"] > 0
    with pytest.raises(ConfigError, match="smallest device count that works at 80 GiB: 20"):
        _ = result.best
    assert plan(w, ClusterSpec(result.min_devices, 80 * GIB), space, search_minimum=False).ranked
    assert not plan(w, ClusterSpec(result.min_devices - 1, 80 * GIB), space, search_minimum=False).ranked
    # the memory that would do at 8 devices is the leanest layout's peak plus the margin
    enough = ClusterSpec(8, int(result.min_memory) + 1)
    assert plan(w, enough, space, search_minimum=False).ranked
    assert result.min_memory == pytest.approx(result.near_misses[0].memory.total / 0.9)


def test_rejections_are_counted_by_reason():
    result = plan(Workload(FLAVORS["qwen2.5-7b"], 4096, "bf16"), ClusterSpec(8, 80 * GIB),
                  SearchSpace(global_batch_size=64))
    assert result.rejected["tp does not divide heads/query groups"] >= 1  # 28 heads, 4 groups: tp=8
    assert result.rejected["pp does not divide layers"] >= 1  # 28 layers: pp=8


def test_component_models_add_to_the_first_stage():
    """A plugin's extra part (e.g. a vision encoder) adds its parameters and activations to stage 0."""

    class Encoder:
        name = "vision"

        def param_count(self, candidate):
            return 600_000_000 // candidate.tp

        def activation_bytes(self, candidate, tokens, workload):
            return tokens * 1024 * workload.param_bytes

        def flops_per_sample(self, workload):
            return 6 * 600e6 * 1024

        def rank_flops_per_sample(self, workload, candidate):
            return self.flops_per_sample(workload)

    from loongforge.planner.layouts import Candidate

    cand = Candidate(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=4)
    plain = Workload(FLAVORS["qwen2.5-7b"], 4096, "bf16")
    vlm = Workload(FLAVORS["qwen2.5-7b"], 4096, "bf16", components=(Encoder(),))
    first = estimate_memory(vlm, cand).per_stage[0] - estimate_memory(plain, cand).per_stage[0]
    assert first == pytest.approx(300_000_000 * (2 + 4 + 12 / 2) + 2 * 4096 * 1024 * 2)


def test_plan_command(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text("model: llama3-70b\ndata: {seq_length: 8192}\n"
                      "training: {precision: bf16, global_batch_size: 128}\n")
    assert main(["plan", str(config), "--devices", "64", "--device-memory", "80GiB", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "tp4 pp4 vpp5 cp2:ulysses dp2" in out and "Rejected" in out and "exceeds memory" in out
    assert main(["plan", str(config), "--devices", "8", "--device-memory", "80GiB"]) == 2
    captured = capsys.readouterr()
    assert "smallest device count that works at 80 GiB: 20" in captured.err
    assert "Nearest misses" in captured.out
