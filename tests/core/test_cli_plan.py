"""``loongforge plan`` agrees with what ``loongforge train --nproc`` runs on this CPU machine, and ``parallel: auto``
never picks the distributed optimizer where there is no data-parallel replica to shard it over."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.devices.cpu import CPUBackend
from loongforge.models.registration import all_flavors
from loongforge.planner.auto import apply_plan, plan_for_run
from loongforge.planner.cli import machine_facts
from loongforge.planner.hardware import GIB, ClusterSpec
from loongforge.planner.layouts import SearchSpace, enumerate_layouts
from loongforge.planner.memory import Workload
from loongforge.planner.planner import plan
from loongforge.resolve import resolve_model_flavor

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
FLAVORS = all_flavors()


@pytest.fixture
def outside_a_launcher(monkeypatch):
    """A 64 GiB host with 2 usable cores, and no launcher environment (a shell running ``loongforge plan``)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOONGFORGE_DEVICE", "cpu")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GIB))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_plan_for_n_cpu_devices_is_the_host_running_n_processes(outside_a_launcher):
    facts = machine_facts(load_config(QUICKSTART), 4)
    # what `train --nproc 4` gives each process: one node of 4, a quarter of the memory, half a core
    assert (facts["ranks_per_node"], facts["device_memory"], facts["device_flops"]) == (4, 16 * GIB, 15e9)
    assert "LOCAL_WORLD_SIZE" not in os.environ  # asked in the workers' environment, then put back
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # inside a launcher its own figure stands
    try:
        assert machine_facts(load_config(QUICKSTART), 4)["ranks_per_node"] == 2
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_plan_devices_2_offers_tp2_which_nproc_2_accepts(outside_a_launcher, capsys):
    assert main(["plan", QUICKSTART, "--devices", "2", "--top", "10"]) == 0
    out = capsys.readouterr().out
    assert "tp larger than a node" not in out
    assert "2 x 32 GiB (2 per node)" in out
    assert "│ tp2 pp1 dp1 " in out  # the layout `train --nproc 2 parallel.tp=2` runs is ranked
    assert main(["check", QUICKSTART, "parallel.tp=2", "--nproc", "2"]) == 0
    assert "parallel: tp=2 pp=1 cp=1 ep=1 dp=1 for 2 process(es)" in capsys.readouterr().out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("plain_too", [False, True])
def test_layouts_at_dp1_never_use_the_distributed_optimizer(world, plain_too):
    space = SearchSpace(global_batch_size=16, allow_plain_optimizer=plain_too)
    layouts = list(enumerate_layouts(FLAVORS["qwen3-0.6b"], world, 4096, 8, space, Counter()))
    assert layouts
    for cand in layouts:
        if cand.dp == 1:
            assert not cand.distributed_optimizer, cand
            assert "distopt" not in cand.describe(28)
    sharded = [cand.distributed_optimizer for cand in layouts if cand.dp > 1]
    assert all(sharded) or plain_too  # with dp > 1 it is offered (and, without plain_too, the only choice)
    assert any(sharded) == (world > 1)


def test_ranked_layouts_shard_the_optimizer_only_over_data_parallel_replicas():
    """Two ranks: dp2 layouts shard it; cp2/pp2/tp2 layouts at dp1 (the issue's machine showed 'cp2 dp1 distopt')
    keep the plain optimizer."""
    result = plan(Workload(FLAVORS["llama-tiny"], 512, "fp32", kernels="local"), ClusterSpec(2, 8 * GIB),
                  SearchSpace(global_batch_size=8))
    assert {(r.candidate.dp, r.candidate.cp) for r in result.ranked} == {(2, 1), (1, 1), (1, 2)}
    for ranked in result.ranked:
        assert ranked.candidate.distributed_optimizer == (ranked.candidate.dp > 1), ranked.candidate


def test_parallel_auto_on_one_process_resolves_without_the_distributed_optimizer(outside_a_launcher):
    config = load_config(QUICKSTART, ["parallel=auto"])
    resolved = apply_plan(config, plan_for_run(config, resolve_model_flavor(config), CPUBackend(), 1))
    assert resolved.parallel.distributed_optimizer is False
    assert (resolved.parallel.tp, resolved.parallel.pp) == (1, 1)
