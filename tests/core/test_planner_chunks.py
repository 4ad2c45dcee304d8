"""The planner chooses the chunked pipeline's count when the config leaves it to it (``parallel.seq_chunks: auto``):
the fewest chunks that fit where memory needs them, none where it does not, never beside cp or vpp, and the config
it writes runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.config.chunk_settings import check_seq_chunks, chunk_counts
from loongforge.errors import ConfigError
from loongforge.planner.auto import search_space, workload_for
from loongforge.planner.hardware import ClusterSpec
from loongforge.planner.layouts import Candidate, RecomputePlan
from loongforge.planner.memory import chunk_kv_bytes, estimate_memory
from loongforge.planner.planner import DEFAULT_MARGIN, plan
from loongforge.planner.timing import estimate_time
from loongforge.resolve import resolve_model_flavor

#: llama-tiny at 16K tokens, one sequence per step, the chunk count the planner's.
CHUNKS_AUTO = """
model: {name: llama-tiny, overrides: {max_position_embeddings: 16384}}
data: {seq_length: 16384}
training: {micro_batch_size: 1, global_batch_size: 1, precision: fp32}
parallel: {seq_chunks: auto}
"""


def _config(tmp_path, text: str = CHUNKS_AUTO, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


def _plan(config, devices: int, memory: float, **facts):
    family = resolve_model_flavor(config)
    workload = workload_for(config, family, "local")
    cluster = ClusterSpec(num_devices=devices, device_memory=int(memory), ranks_per_node=devices, **facts)
    return workload, plan(workload, cluster, search_space(config, family), search_minimum=False)


def test_counts_offered_are_powers_of_two_down_to_the_shortest_chunk(tmp_path):
    config = _config(tmp_path)
    assert chunk_counts(config, resolve_model_flavor(config).decoder) == (1, 2, 4, 8, 16, 32, 64)
    short = _config(tmp_path, CHUNKS_AUTO, "data.seq_length=1536")  # 1536 = 3 x 512: chunks of >= 256 tokens
    assert chunk_counts(short, resolve_model_flavor(short).decoder) == (1, 2, 4)
    fixed = _config(tmp_path, CHUNKS_AUTO, "parallel.seq_chunks=8")
    assert chunk_counts(fixed, resolve_model_flavor(fixed).decoder) == (8,)


def test_memory_falls_with_the_chunk_count_and_keeps_the_sequence_kv(tmp_path):
    workload, _ = _plan(_config(tmp_path), devices=1, memory=64 * 2**30)
    peaks = [estimate_memory(workload, Candidate(tp=1, pp=1, dp=1, seq_chunks=n, distributed_optimizer=False))
             for n in (1, 2, 4, 8, 16)]
    totals = [p.total for p in peaks]
    assert totals == sorted(totals, reverse=True) and totals[0] > 2.5 * totals[-1]
    # What chunking cannot shrink: every layer keeps the whole sequence's K/V (recorded, in fp32 here) and the fp32
    # gradients of all but one chunk; llama-tiny: 2 K/V groups x 64 dims, 4 layers on one stage.
    terms = workload.terms()
    assert terms.kv_width == 2 * 64
    kv_per_layer = 16384 * 2 * terms.kv_width * 4
    unchunked_act = peaks[0].terms["activations"]
    floor = 4 * kv_per_layer * (1 + 15 / 16)
    assert peaks[-1].terms["activations"] > floor
    assert peaks[-1].terms["activations"] - floor < unchunked_act / 8  # the chunk's share is small beside it


def test_kv_terms_by_hand_with_the_kernel_s_tiles(tmp_path):
    """6144 tokens in 4 chunks of 1536: the chunk attention scores tiles of 384 tokens (1536 halved while above 512),
    not 512 or the whole chunk; llama-tiny fp32, one stage of 4 layers, 4 heads, K/V 2 x 64 wide."""
    workload, _ = _plan(_config(tmp_path, CHUNKS_AUTO, "data.seq_length=6144"), devices=1, memory=64 * 2**30)
    kept, transient = chunk_kv_bytes(workload, Candidate(tp=1, pp=1, dp=1, seq_chunks=4, distributed_optimizer=False))
    kv = 6144 * 2 * 128  # K and V elements of the sequence, per layer
    assert kept == 4 * kv * (4 + 3 / 4 * 4)  # records (fp32) and the gradients of 3 of 4 chunks, 4 layers
    query = 1536 * 256
    assert transient == 2 * kv * 4 + 3 * query * 4 + 4 * (4 * 384 * 384 * 4)


def test_recording_pass_costs_a_forward_and_chunks_shrink_the_bubble(tmp_path):
    workload, _ = _plan(_config(tmp_path), devices=2, memory=64 * 2**30)
    cluster = ClusterSpec(num_devices=2, device_memory=64 * 2**30, ranks_per_node=2)
    one = estimate_time(workload, Candidate(tp=1, pp=1, dp=1, distributed_optimizer=False), cluster)
    cut = estimate_time(workload, Candidate(tp=1, pp=1, dp=1, seq_chunks=4, distributed_optimizer=False), cluster)
    assert cut.terms["compute"] == pytest.approx(one.terms["compute"] * 4 / 3, rel=0.02)  # fwd+bwd is 3 forwards
    piped = [estimate_time(workload, Candidate(tp=1, pp=2, dp=1, seq_chunks=n, distributed_optimizer=False), cluster)
             for n in (1, 4)]
    slowest = [t.terms["compute"] + t.terms["stage_imbalance"] for t in piped]  # the pace of the slowest stage
    assert piped[0].terms["bubble"] == pytest.approx(slowest[0], rel=1e-6)  # (pp-1)/m with m=1
    assert piped[1].terms["bubble"] == pytest.approx(slowest[1] / 4, rel=1e-6)  # m counts the 4 chunks


def test_no_chunks_where_memory_does_not_need_them_at_one_stage(tmp_path):
    _workload, roomy = _plan(_config(tmp_path), devices=1, memory=64 * 2**30)
    assert roomy.best.candidate.seq_chunks == 1  # the recording pass would cost a forward for nothing


def test_the_fewest_chunks_that_fit_where_even_full_recompute_does_not(tmp_path):
    """At one stage a chunk count costs a forward, full recompute at most one: chunks win only below what full
    recompute needs (its one re-run layer's activations of the whole sequence)."""
    workload, _ = _plan(_config(tmp_path), devices=1, memory=64 * 2**30)
    full = Candidate(tp=1, pp=1, dp=1, distributed_optimizer=False, recompute=RecomputePlan("full", num_layers=4))
    need = estimate_memory(workload, full).total
    _workload, tight = _plan(_config(tmp_path), devices=1, memory=0.8 * need / (1 - DEFAULT_MARGIN))
    best = tight.best.candidate
    assert best.seq_chunks > 1 and tight.best.memory.total <= tight.budget
    assert estimate_memory(workload, replace(best, seq_chunks=best.seq_chunks // 2)).total > tight.budget
    assert f"chunks{best.seq_chunks}" in tight.best.describe(tight.workload)
    # with room for full recompute, it is the cheaper of the two
    _workload, recompute = _plan(_config(tmp_path), devices=1, memory=1.01 * need / (1 - DEFAULT_MARGIN))
    assert recompute.best.candidate.seq_chunks == 1 and recompute.best.candidate.recompute.granularity == "full"


def test_chunks_at_two_stages_shrink_the_bubble_enough_to_win(tmp_path):
    """One sequence per step at pp=2: unchunked, a stage idles half the step; four chunks cut the idle share to a
    fifth for one more forward -- the planner takes chunks for time, not only for memory."""
    _workload, result = _plan(_config(tmp_path), devices=2, memory=64 * 2**30, device_flops=1e9)
    piped = [ev for ev in result.ranked if ev.candidate.pp == 2]
    assert piped and all(ev.candidate.seq_chunks > 1 for ev in piped)


def test_chunks_never_beside_cp_tp_or_vpp(tmp_path):
    _workload, result = _plan(_config(tmp_path, CHUNKS_AUTO, "parallel.cp_mode=auto"), devices=4,
                              memory=0.25 * 2**30)
    assert result.ranked and any(ev.candidate.seq_chunks > 1 for ev in result.ranked)
    for ev in result.ranked:
        cand = ev.candidate
        chunked = cand.seq_chunks > 1
        assert not chunked or (cand.cp, cand.tp, cand.vpp) == (1, 1, 1), ev.describe(result.workload)
    # a fixed count holds every layout to cp=1 without vpp, each of them chunked
    _workload, fixed = _plan(_config(tmp_path, CHUNKS_AUTO, "parallel.seq_chunks=8", "parallel.cp_mode=auto"),
                             devices=4, memory=64 * 2**30)
    assert fixed.ranked and all(ev.candidate.seq_chunks == 8 and ev.candidate.cp == 1 and ev.candidate.vpp == 1
                                for ev in fixed.ranked)
    assert fixed.rejected["parallel.seq_chunks needs cp=1"] > 0


def test_a_model_that_rules_chunking_out_gets_no_chunks_and_a_one_line_check(tmp_path):
    moe = CHUNKS_AUTO.replace("llama-tiny, overrides: {max_position_embeddings: 16384}",
                              "qwen3-moe-tiny, overrides: {max_position_embeddings: 16384}")
    config = _config(tmp_path, moe, "parallel.auto=true")
    decoder = resolve_model_flavor(config).decoder
    assert chunk_counts(config, decoder) == (1,)
    with pytest.raises(ConfigError, match=r"parallel\.seq_chunks \(auto\): not with a mixture-of-experts decoder"):
        check_seq_chunks(config, decoder, cp=1, vpp=None)


def test_auto_needs_the_planner(tmp_path, capsys):
    path = tmp_path / "fixed.yaml"
    path.write_text(CHUNKS_AUTO)
    assert main(["check", str(path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.seq_chunks auto is the planner's to choose" in err[0]


def test_written_config_runs_with_the_chosen_count(tmp_path, capsys):
    """One K/V group (no Ulysses, no tp) on two devices at a budget one pipeline stage of a whole sequence misses: the
    two-stage pipeline with chunks, written as a config ``check`` accepts."""
    source = tmp_path / "auto.yaml"
    source.write_text(CHUNKS_AUTO.replace("overrides: {", "overrides: {num_query_groups: 1, "))
    workload, _ = _plan(load_config(str(source), ["data.seq_length=8192"]), devices=2, memory=64 * 2**30)
    unchunked = max(estimate_memory(workload, Candidate(tp=1, pp=2, dp=1, distributed_optimizer=False)).per_stage)
    memory = f"{int(0.7 * unchunked / (1 - DEFAULT_MARGIN))}"
    written = tmp_path / "planned.yaml"
    assert main(["plan", str(source), "--devices", "2", "--device-memory", memory, "--kernels", "local",
                 "--seq-length", "8192", "--write", str(written)]) == 0
    raw = yaml.safe_load(written.read_text())
    chunks = raw["parallel"]["seq_chunks"]
    assert isinstance(chunks, int) and chunks > 1 and raw["data"]["seq_length"] == 8192
    assert raw["parallel"]["auto"] is False and (raw["parallel"]["cp"], raw["parallel"]["pp"]) == (1, 2)
    capsys.readouterr()
    assert main(["check", str(written), "--nproc", "2"]) == 0
    assert f"each sequence in {chunks} chunks (chunked pipeline)" in capsys.readouterr().out


def test_parallel_auto_trains_with_the_chunks_it_chose(tmp_path):
    """``parallel: auto`` with ``seq_chunks: auto`` through the trainer, at a budget full recompute misses: the run
    trains chunked and records the count it chose."""
    import json
    import os
    import subprocess
    import sys

    text = (f"run: {{output_dir: {tmp_path / 'run'}, seed: 1}}\n"
            "model: {name: llama-debug, overrides: {max_position_embeddings: 2048}}\n"
            "parallel: {auto: true, seq_chunks: auto}\ndata: {seq_length: 2048}\n"
            "training: {steps: 2, micro_batch_size: 1, global_batch_size: 1, threads: 1}\n"
            "logging: {progress: false, tensorboard: false}\n")
    config = _config(tmp_path, text)
    workload, _ = _plan(config, devices=1, memory=64 * 2**30)
    full = Candidate(tp=1, pp=1, dp=1, distributed_optimizer=False, recompute=RecomputePlan("full", num_layers=2))
    memory = int(0.8 * estimate_memory(workload, full).total / (1 - DEFAULT_MARGIN))
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(tmp_path / "run.yaml"),
                           f"parallel.planner.device_memory={memory}"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metadata = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/metadata.json")).read_text())
    chunks = metadata["parallel_auto"]["parallel"]["seq_chunks"]
    assert chunks > 1 and f"chunks{chunks}" in done.stdout
    saved = yaml.safe_load(next((tmp_path / "run" / "checkpoints").glob("*/config.yaml")).read_text())
    assert saved["parallel"]["seq_chunks"] == chunks  # the run's resolved config: the count it recorded as chosen
