"""The longest sequence ``llama-tiny`` trains on N CPU processes within a memory budget, with the long-context features
(ring and hybrid cp, the chunked pipeline) left to the planner and without them.

Two settings of the same config, one sequence per step, fp32:

* **without**: what LoongForge had before them -- Ulysses cp (heads and query groups divide by tp*cp), tp, pp and
  recompute, chosen by the planner (``parallel: auto``);
* **with**: ``parallel.cp_mode: auto`` and ``parallel.seq_chunks: auto`` on top. Activation offload is left out: on
  the CPU, host and device are one memory, so moving activations to the host frees nothing there.

For each, the planner (``loongforge plan`` with ``--seq-length``, the budget split evenly over the processes: on CPU
they share one memory) is asked at growing lengths (powers of two and 1.5x them) for the longest that fits. A step at
those lengths is out of reach of a 2-core machine (attention's work grows with the square of the length), so each
chosen layout is then *measured* at ``--verify-seq`` tokens -- the same parallel sizes and recompute, as many
chunks as leave chunks of >= 256 tokens -- through ``loongforge.train.measure`` (torchrun + gloo, every rank's peak
live tensor bytes), next to the memory model's prediction for that run: the ratio says how far the longest length
can be trusted.

    python benchmarks/longest_sequence.py                           # 4 processes, 24 GiB; ~10 minutes on 2 cores
    python benchmarks/longest_sequence.py --verify-seq 0            # the planner's answer only, seconds

Baseline: the "without" setting (ratio = longest with / longest without).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml
from loongforge.config import load_config
from loongforge.config.chunk_settings import MIN_CHUNK_TOKENS
from loongforge.config.loader import config_to_dict
from loongforge.planner.auto import apply_plan, search_space, workload_for
from loongforge.planner.hardware import ClusterSpec, parse_bytes
from loongforge.planner.memory import estimate_memory
from loongforge.planner.planner import Plan, plan
from loongforge.resolve import resolve_model_flavor

CONFIG = """
run: {{seed: 1}}
model: {{name: llama-tiny, overrides: {{max_position_embeddings: {seq}}}}}
data: {{seq_length: {seq}}}
training: {{micro_batch_size: 1, global_batch_size: 1, precision: fp32, threads: 1}}
parallel: {{auto: true{parallel}}}
logging: {{interval: 1}}
"""
SETTINGS = {
    "without": "",
    "with": ", cp_mode: auto, seq_chunks: auto",
}


def config_text(setting: str, seq: int) -> str:
    return CONFIG.format(seq=seq, parallel=SETTINGS[setting])


def plan_at(root: Path, setting: str, seq: int, cluster: ClusterSpec) -> tuple[object, Plan]:
    path = root / f"{setting}-{seq}.yaml"
    path.write_text(config_text(setting, seq))
    config = load_config(str(path))
    family = resolve_model_flavor(config)
    return config, plan(workload_for(config, family, "local"), cluster, search_space(config, family),
                        search_minimum=False)


def longest(root: Path, setting: str, cluster: ClusterSpec, start: int = 4096) -> tuple[int, object, Plan]:
    """The longest length among ``start * 2^k`` and 1.5x those that some layout fits."""
    best = None
    seq = start
    while True:
        for length in (seq, seq * 3 // 2):
            config, result = plan_at(root, setting, length, cluster)
            if not result.ranked:
                if best is None:
                    raise SystemExit(f"{setting}: nothing fits even {length} tokens")
                return best
            best = (length, config, result)
        seq *= 2


def measured_peak(root: Path, config: object, result: Plan, seq: int, nproc: int) -> tuple[float, float, str]:
    """(predicted, measured) peak bytes of the chosen layout run at ``seq`` tokens, and its description there."""
    candidate = result.best.candidate
    chunks = min(candidate.seq_chunks, max(1, seq // MIN_CHUNK_TOKENS))
    candidate = replace(candidate, seq_chunks=chunks)
    resolved = config_to_dict(apply_plan(config, result))
    resolved["data"]["seq_length"] = seq
    resolved["model"]["overrides"]["max_position_embeddings"] = seq
    resolved["parallel"]["seq_chunks"] = chunks
    path = root / f"verify-{seq}-{len(list(root.glob('verify-*')))}.yaml"
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    short = load_config(str(path))
    workload = workload_for(short, resolve_model_flavor(short), "local")
    estimate = estimate_memory(workload, candidate)
    out = path.with_suffix("")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "loongforge.train.measure", str(path), str(out), "--time-steps=0", "--memory-steps=1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{path}: exit {done.returncode}\n{done.stderr[-4000:]}")
    measured = max(json.loads(p.read_text())["peak_bytes"] for p in out.glob("rank*.json"))
    return estimate.total + estimate.host_bytes, measured, candidate.describe(workload.terms().num_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--memory", default="24GiB", help="memory of the whole run (the processes share it)")
    parser.add_argument("--verify-seq", type=int, default=8192, help="tokens of the measured runs (0: none)")
    args = parser.parse_args()
    budget = parse_bytes(args.memory, "--memory")
    # The CPU's speeds only rank layouts that fit; what fits is memory alone.
    cluster = ClusterSpec(num_devices=args.processes, device_memory=budget // args.processes,
                          ranks_per_node=args.processes, device_flops=2e10, intra_node_bandwidth=5e9,
                          inter_node_bandwidth=5e9, host_bandwidth=5e9)
    print(f"llama-tiny, fp32, one sequence per step, {args.processes} processes sharing {args.memory} "
          f"({cluster.device_memory / 2**30:.1f} GiB each, 10% kept free)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        found = {setting: longest(root, setting, cluster) for setting in SETTINGS}
        for setting, (length, config, result) in found.items():
            best = result.best
            print(f"{setting:8s} longest {length:>9,d} tokens: {best.describe(result.workload)}, predicted "
                  f"{best.memory.total / 2**30:.2f} GiB per process", flush=True)
            if args.verify_seq:
                predicted, measured, layout = measured_peak(root, config, result, args.verify_seq, args.processes)
                print(f"{'':8s} measured at {args.verify_seq} tokens ({layout}): {measured / 2**20:.1f} MiB, "
                      f"predicted {predicted / 2**20:.1f} MiB, ratio {predicted / measured:.3f}", flush=True)
        ratio = found["with"][0] / found["without"][0]
        print(f"longest with / without: {ratio:.2f}x")


if __name__ == "__main__":
    main()
