"""The task-engine planner on a family stated by hand (no plugin): each memory term split as the torch-native
strategies split it, layouts the terms rule out never proposed, ranking by time per sample, and the answer when
nothing fits."""

from __future__ import annotations

from collections import Counter

import pytest
from loongforge.errors import ConfigError
from loongforge.models.task_terms import BlockActivations, TaskTerms
from loongforge.planner.hardware import GIB, ClusterSpec
from loongforge.planner.task_planner import TaskCandidate, estimate_task_memory, plan_task, task_layouts

ACTS = BlockActivations(replicated_per_token=100.0, split_per_token=300.0, split_per_sample=1000.0,
                        outside_per_token=10.0, recompute_per_token=8.0, backward_per_token=20.0)


def terms(**changes) -> TaskTerms:
    values = dict(blocks=4, block_split_params=900.0, block_replicated_params=100.0, outside_params=1000.0,
                  tokens=64, heads=8, hidden=16, block_forward_flops=1e9, outside_forward_flops=1e7,
                  activations={"fp32": ACTS, "bf16": BlockActivations(50.0, 150.0, 500.0, 5.0, 4.0, 20.0)},
                  context_parallel=True, tensor_parallel=True, recompute_option="task.recompute", tp_divides=(12,))
    return TaskTerms(**{**values, **changes})


def test_memory_terms_by_hand():
    t = terms(models=2)
    # fsdp2 on 8 ranks, tp 2, cp 2: parameters of a tp rank are 4 x (900 / 2 + 100) + 1000 = 3200, sharded over 4
    fsdp = estimate_task_memory(t, TaskCandidate("fsdp2", 8, cp=2, tp=2, micro_batch_size=3), "bf16").terms
    assert fsdp["weights"] == 4 * 3200 * 2 / 4 and fsdp["optimizer"] == 8 * 3200 * 2 / 4
    assert fsdp["grads"] == 4 * 3200 * 1 / 4  # one of the two models trained per step
    assert fsdp["gathered"] == 2 * (1000 + 2 * 550) + 4 * 550  # bf16 root and two blocks, one fp32 gradient
    tokens = 3 * 64 / 2
    one_block = tokens * (50 + 150 / 2) + 3 * 500 / 2
    assert fsdp["activations"] == 4 * one_block + tokens * 5
    assert fsdp["backward_peak"] == tokens * 20
    # DDP holds everything whole, computes in fp32 whatever the precision, and its buckets hold both models' grads
    ddp = estimate_task_memory(t, TaskCandidate("ddp", 8, micro_batch_size=3), "bf16").terms
    params = 4 * 1000 + 1000
    assert (ddp["weights"], ddp["grads"], ddp["optimizer"]) == (4 * params * 2, 4 * params * 2, 8 * params * 2)
    assert "gathered" not in ddp and ddp["activations"] == 4 * (3 * 64 * 400 + 3 * 1000) + 3 * 64 * 10
    zero1 = estimate_task_memory(t, TaskCandidate("zero1", 8, micro_batch_size=3), "bf16").terms
    assert zero1["optimizer"] == 8 * params * 2 / 8 and zero1["weights"] == ddp["weights"]
    hsdp = estimate_task_memory(t, TaskCandidate("hsdp", 8, shard_size=2, micro_batch_size=3), "bf16").terms
    assert hsdp["weights"] == 4 * params * 2 / 2
    recomputed = estimate_task_memory(t, TaskCandidate("ddp", 8, recompute=True, micro_batch_size=3), "fp32").terms
    assert recomputed["activations"] == 4 * 3 * 64 * 8 + 3 * 64 * 10
    assert recomputed["backward_peak"] == 3 * 64 * 400 + 3 * 1000


def test_layouts_respect_what_the_terms_allow():
    cluster = ClusterSpec(num_devices=8, device_memory=80 * GIB, ranks_per_node=4)
    rejected: Counter = Counter()
    layouts = list(task_layouts(terms(tp_divides=(24,)), cluster, 1, rejected))
    assert {c.strategy for c in layouts} == {"ddp", "zero1", "fsdp2", "hsdp"}
    assert all(c.tp <= 4 and (c.tp == 1 or c.strategy == "fsdp2") for c in layouts)
    assert rejected["tp spans nodes"] > 0
    rejected.clear()
    layouts = list(task_layouts(terms(heads=4), cluster, 1, rejected))  # and widths of 12
    assert all(4 % (c.cp * c.tp) == 0 and 12 % c.tp == 0 for c in layouts)
    assert rejected["heads (or widths) not divisible by tp x cp"] > 0
    only = list(task_layouts(terms(strategies=("ddp",), context_parallel=False, recompute_option=None), cluster, 1,
                             Counter()))
    assert {(c.strategy, c.cp, c.tp, c.recompute) for c in only} == {("ddp", 1, 1, False)}
    assert all(c.cp == 1 for c in task_layouts(terms(tokens=63), cluster, 1, Counter()))
    assert [c.strategy for c in task_layouts(terms(), cluster.with_(num_devices=1), 1, Counter())] == ["single"] * 2


def test_ranked_by_time_per_sample_and_infeasible_names_what_would_fit():
    """On a slow link, splitting a sample (cp, tp) costs communication that data parallelism does not: dp 8 wins
    per sample though each of its steps (8 samples) takes longer than a cp 8 step (1 sample)."""
    slow = ClusterSpec(num_devices=8, device_memory=80 * GIB, intra_node_bandwidth=1e6)
    result = plan_task(terms(block_forward_flops=1e15), slow, precision="bf16")
    paces = [float(f"{ev.pace:.3g}") for ev in result.ranked]
    assert paces == sorted(paces)
    best = result.best
    split = next(ev for ev in result.ranked if ev.candidate.cp == 8)
    assert best.candidate.dp == 8 and best.time.total > split.time.total
    big = terms(block_split_params=4e9)  # 16 B/param x 16e9 on one 80 GiB device: only sharding fits
    alone = plan_task(big, ClusterSpec(num_devices=1, device_memory=80 * GIB), precision="bf16")
    assert not alone.ranked and alone.min_devices is not None and alone.min_devices > 1
    with pytest.raises(ConfigError, match=f"smallest device count that works at 80 GiB: {alone.min_devices}"):
        _ = alone.best


def test_a_run_its_options_keep_to_one_process_says_so():
    pinned = terms(strategies=(), notes=("task.experts_resident: one: one process",))
    result = plan_task(pinned, ClusterSpec(num_devices=4, device_memory=80 * GIB), precision="bf16")
    assert result.infeasible_message() == ("no layout of this model runs on 4 device(s): task.experts_resident: one: "
                                           "one process")


def test_terms_are_checked():
    with pytest.raises(ConfigError, match="activations must be stated for bf16"):
        terms(activations={"fp32": ACTS})
    with pytest.raises(ConfigError, match="models_per_step"):
        terms(models=1, models_per_step=2)
