"""The planner chooses the context-parallel mode and activation offload when the config leaves them to it
(``parallel.cp_mode: auto``, ``training.offload_activations.layers: auto``), and the config it writes runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.planner.auto import search_space, workload_for
from loongforge.planner.hardware import ClusterSpec
from loongforge.planner.layouts import Candidate, RecomputePlan
from loongforge.planner.memory import estimate_memory
from loongforge.planner.planner import DEFAULT_MARGIN, plan
from loongforge.resolve import resolve_model_flavor

#: llama-tiny with one K/V group (Ulysses splits groups over tp*cp: impossible at cp > 1, and tp > 1 too) and three
#: layers (no pipeline of 2): on two devices with one sample per step, cp=2 is the only way to use them.
MQA = """
model: {name: llama-tiny, overrides: {num_query_groups: 1, num_layers: 3, max_position_embeddings: 4096}}
data: {seq_length: 4096}
training: {micro_batch_size: 1, global_batch_size: 1}
parallel: {cp_mode: auto}
"""
#: llama-tiny as shipped (4 heads, 2 K/V groups: Ulysses and the ring both split cp=2).
GQA = MQA.replace("num_query_groups: 1, num_layers: 3, ", "")
#: The planner may offload (``layers: auto``); MQA_ marks what the MQA variant adds.
OFFLOAD_AUTO = """
model: {name: llama-tiny, overrides: {MQA_max_position_embeddings: 4096}}
data: {seq_length: 4096}
training: {micro_batch_size: 1, global_batch_size: 1, offload_activations: {layers: auto}}
parallel: {cp_mode: auto}
"""


def _config(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_config(str(path))


def _plan(config, devices: int, memory: float = 64 * 2**30, **facts):
    family = resolve_model_flavor(config)
    workload = workload_for(config, family, "local")
    cluster = ClusterSpec(num_devices=devices, device_memory=int(memory), ranks_per_node=devices, **facts)
    return workload, plan(workload, cluster, search_space(config, family), search_minimum=False)


def test_ring_when_heads_do_not_divide_tp_times_cp(tmp_path):
    _workload, result = _plan(_config(tmp_path, MQA), devices=2)
    best = result.best.candidate
    assert (best.cp, best.cp_mode, best.cp_a2a_size) == (2, "ring", None)
    assert {ev.candidate.cp_mode for ev in result.ranked} == {"ring"}
    assert any("query groups" in why for why in result.rejected)  # Ulysses was offered and refused, with a reason
    assert "cp2:ring" in result.best.describe(result.workload)


def test_hybrid_at_every_a2a_size_next_to_the_ring(tmp_path):
    """At cp=4 llama-tiny's two K/V groups do not split four ways (no Ulysses) but do split over a2a=2: the ring and
    hybrid with two Ulysses sub-groups are both layouts of their own."""
    _workload, result = _plan(_config(tmp_path, GQA), devices=4)
    at_cp4 = {(ev.candidate.cp_mode, ev.candidate.cp_a2a_size) for ev in result.ranked
              if ev.candidate.cp == 4 and ev.candidate.tp == 1}
    assert at_cp4 == {("ring", None), ("hybrid", 2)}


def _hand_cp_seconds(mode: str, cluster: ClusterSpec, seq: int, q: int, kv: int, attention_flops: float) -> float:
    """Context-parallel exchange of one layer at cp=2, tp=1, fp32, recomputed from the description: Ulysses moves
    half of (q, k, v, out) each way; the ring sends its K/V block once each way, hidden behind half the attention
    compute (the backward's twice the forward's), then its fp32 K/V gradients twice."""
    tokens = seq / 2
    if mode == "ulysses":
        return 2 * (0.5 * tokens * (2 * q + 2 * kv) * 4 / cluster.intra_node_bandwidth + cluster.latency)
    hop = tokens * 2 * kv * 4 / cluster.intra_node_bandwidth + cluster.latency
    share = attention_flops * tokens / cluster.device_flops / 2
    return max(0.0, hop - share) + max(0.0, hop - 2 * share) + 2 * hop


@pytest.mark.parametrize(("device_flops", "cheaper"), [(1e15, "ulysses"), (1e9, "ring")])
def test_the_cheaper_mode_by_the_time_model_ranks_first(tmp_path, device_flops, cheaper):
    """Fast compute leaves the ring's hops exposed (more bytes than Ulysses' all-to-alls for these heads); slow
    compute hides them, leaving the ring only its gradient hops, fewer bytes than the all-to-alls."""
    config = _config(tmp_path, GQA)
    workload, result = _plan(config, devices=2, device_flops=device_flops)
    at_cp2 = [ev for ev in result.ranked if ev.candidate.cp == 2 and ev.candidate.recompute.granularity == "none"]
    assert [ev.candidate.cp_mode for ev in at_cp2][0] == cheaper
    assert {ev.candidate.cp_mode for ev in at_cp2} == {"ulysses", "ring"}
    flavor = workload.flavor
    q, kv = flavor.num_attention_heads * flavor.kv_channels, flavor.num_query_groups * flavor.kv_channels
    attention = 2 * q * 4096  # forward FLOPs per token of causal attention's two products (s/2 positions, x2)
    for ev in at_cp2:
        layers = flavor.num_layers
        expected = _hand_cp_seconds(ev.candidate.cp_mode, result.cluster, 4096, q, kv, attention) * layers
        assert ev.time.terms["cp_comm"] == pytest.approx(expected, rel=1e-9)


def test_ring_memory_counts_its_score_blocks_and_kv_in_flight(tmp_path):
    """The ring's backward holds four fp32 score blocks per head for a pair of chunks, fp32 copies of q, dO and dq,
    and two K/V blocks and two fp32 K/V-gradient blocks; Ulysses none of it (counted by hand, cp=2, fp32)."""
    config = _config(tmp_path, GQA)
    workload = workload_for(config, resolve_model_flavor(config), "local")
    flavor = workload.flavor
    ulysses = Candidate(tp=1, pp=1, dp=1, cp=2, distributed_optimizer=False)
    ring = replace(ulysses, cp_mode="ring")
    tokens, chunk = 4096 / 2, 4096 / 4
    q = tokens * flavor.num_attention_heads * flavor.kv_channels
    kv = tokens * flavor.num_query_groups * flavor.kv_channels
    extra = 4 * flavor.num_attention_heads * chunk * chunk * 4 + 3 * q * 4 + 2 * 2 * kv * 4 + 2 * 2 * kv * 4
    difference = estimate_memory(workload, ring).total - estimate_memory(workload, ulysses).total
    assert difference == pytest.approx(extra, rel=1e-9)


def _offload_plan(tmp_path, memory: float, host_gbps: float):
    config = _config(tmp_path, OFFLOAD_AUTO.replace("MQA_", ""))
    return _plan(config, devices=1, memory=memory, host_bandwidth=host_gbps * 1e9, device_flops=30e9)


def test_offload_only_when_memory_needs_it(tmp_path):
    workload, roomy = _offload_plan(tmp_path, 64 * 2**30, host_gbps=1000)
    assert roomy.best.candidate.offload_layers == 0  # it fits: no host traffic for nothing
    alone = Candidate(tp=1, pp=1, dp=1, distributed_optimizer=False)
    need = estimate_memory(workload, alone).total
    # A budget the plain layout misses: with a fast host link the copies hide behind compute, so offloading the
    # fewest layers that fit beats recompute (which re-runs compute).
    _workload, tight = _offload_plan(tmp_path, 0.9 * need / (1 - DEFAULT_MARGIN), host_gbps=1000)
    best = tight.best
    k = best.candidate.offload_layers
    assert k > 0 and best.candidate.recompute.granularity == "none" and best.time.terms["offload"] == 0
    assert best.memory.total <= tight.budget
    assert estimate_memory(workload, replace(best.candidate, offload_layers=k - 1)).total > tight.budget
    # Over a slow link the copies show and recompute is cheaper.
    _workload, slow = _offload_plan(tmp_path, 0.9 * need / (1 - DEFAULT_MARGIN), host_gbps=0.001)
    assert slow.best.candidate.offload_layers == 0 and slow.best.candidate.recompute != RecomputePlan()


def test_written_config_round_trips_through_load_config_and_check(tmp_path, capsys):
    source = tmp_path / "auto.yaml"
    source.write_text(OFFLOAD_AUTO.replace("MQA_", "num_query_groups: 1, num_layers: 3, "))
    config = load_config(str(source))
    workload, _ = _plan(config, devices=2)
    one_rank = estimate_memory(workload, Candidate(tp=1, pp=1, dp=1, cp=2, cp_mode="ring",
                                                   distributed_optimizer=False)).total
    memory = f"{int(0.9 * one_rank / (1 - DEFAULT_MARGIN))}"  # the ring at cp=2 alone misses: offload is needed
    written = tmp_path / "planned.yaml"
    assert main(["plan", str(source), "--devices", "2", "--device-memory", memory, "--kernels", "local",
                 "--device-tflops", "0.03", "--host-gbps", "1000", "--write", str(written)]) == 0
    raw = yaml.safe_load(written.read_text())
    assert raw["parallel"]["cp"] == 2 and raw["parallel"]["cp_mode"] == "ring" and raw["parallel"]["auto"] is False
    layers = raw["training"]["offload_activations"]["layers"]
    assert layers and layers == list(range(len(layers)))  # the first k layers of the one stage
    reloaded = load_config(str(written))
    assert (reloaded.parallel.cp_mode, reloaded.training.offload_activations.layers) == ("ring", layers)
    capsys.readouterr()
    assert main(["check", str(written), "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "cp=2 ring" in out and f"activation offload: {len(layers)} of 3 layer(s)" in out


def test_auto_values_need_the_planner(tmp_path, capsys):
    """A fixed layout must name its cp mode and offloaded layers: ``auto`` is refused in one line naming the key."""
    path = tmp_path / "fixed.yaml"
    path.write_text(MQA.replace("parallel: {cp_mode: auto}", "parallel: {cp: 2, cp_mode: auto}"))
    assert main(["check", str(path), "--nproc", "2"]) != 0
    assert "parallel.cp_mode auto is the planner's to choose" in capsys.readouterr().err
    path.write_text(OFFLOAD_AUTO.replace("MQA_", "").replace("parallel: {cp_mode: auto}", ""))
    assert main(["check", str(path)]) != 0
    assert "training.offload_activations.layers is auto" in capsys.readouterr().err
