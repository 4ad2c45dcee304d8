"""Peak memory per pipeline stage of the chunked pipeline (``parallel.seq_chunks``) against the unchunked run.

``llama-tiny`` (positions extended to the sequence) trains one sequence per step at pp=2 (torchrun + gloo, 2
processes), unchunked and cut into chunks, through ``loongforge.train.measure`` (``run_training`` under the
profiler's allocator events: each rank's peak live tensor bytes, without the ~360 MB of imports an RSS would add).
With one sequence per step, the unchunked pipeline holds a whole sequence's activations on each stage; chunked,
a stage holds the chunks the 1F1B schedule keeps in flight (up to pp on the first stage) plus every layer's K/V of
the sequence.

    python benchmarks/chunk_pipeline_memory.py --seq 2048 --chunks 4      # a minute
    python benchmarks/chunk_pipeline_memory.py --seq 16384 --chunks 4,8   # the docs' numbers
    python benchmarks/chunk_pipeline_memory.py --seq 32768 --chunks 16 --memory-steps 1   # one step per run

Baseline for the ratios: the same run with ``parallel.seq_chunks: 1`` (ratio = unchunked peak / chunked peak).
Next to each measured peak, the planner's prediction for that stage (``loongforge.planner.memory.estimate_memory`` of
the layout with ``seq_chunks``, default coefficients; ``pred/meas``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loongforge.config import load_config
from loongforge.planner.auto import workload_for
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import estimate_memory
from loongforge.resolve import resolve_model_flavor

CONFIG = """
run: {{seed: 1}}
model: {{name: llama-tiny, overrides: {{max_position_embeddings: {seq}}}}}
data: {{seq_length: {seq}}}
training: {{micro_batch_size: 1, global_batch_size: 1, threads: 1}}
logging: {{interval: 1}}
"""


def stage_peaks(config: Path, out: Path, chunks: int, pp: int, memory_steps: int = 2) -> dict[int, int]:
    """Peak live tensor bytes of each pipeline stage of one measured run (``memory_steps`` 1: no timed run either,
    for sequences whose chunked steps take many minutes; llama-tiny's Adam moments, which only the second step holds,
    are 12 MB per model, split over the stages: under 1% of a 32K peak)."""
    timed = 1 if memory_steps > 1 else 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp),
               "-m", "loongforge.train.measure", str(config), str(out), f"--time-steps={timed}",
               f"--memory-steps={memory_steps}", f"parallel.pp={pp}", f"parallel.seq_chunks={chunks}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"seq_chunks={chunks}: exit {done.returncode}\n{done.stderr[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    return {r["stage"]: r["peak_bytes"] for r in ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384, help="tokens per sequence")
    parser.add_argument("--chunks", default="4,8", help="comma-separated chunk counts to compare with 1")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--memory-steps", type=int, default=2, help="profiled steps per run (1: the quick way)")
    args = parser.parse_args()
    counts = [int(c) for c in args.chunks.split(",")]
    print(f"llama-tiny, seq {args.seq}, pp={args.pp}, micro-batch 1, fp32, CPU (gloo); peak live tensors per stage")
    print(f"{'seq_chunks':>10s} " + " ".join(f"{f'stage {s} MiB':>12s} {'ratio':>6s} {'pred/meas':>9s}"
                                             for s in range(args.pp)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "long.yaml"
        config.write_text(CONFIG.format(seq=args.seq))
        resolved = load_config(str(config))
        workload = workload_for(resolved, resolve_model_flavor(resolved), "local")
        baseline = None
        for chunks in [1, *counts]:
            predicted = estimate_memory(workload, Candidate(tp=1, pp=args.pp, dp=1, seq_chunks=chunks,
                                                            distributed_optimizer=False)).per_stage
            peaks = stage_peaks(config, root / f"chunks{chunks}", chunks, args.pp, args.memory_steps)
            baseline = baseline or peaks
            print(f"{chunks:10d} " + " ".join(f"{peaks[s] / 2**20:12.1f} {baseline[s] / peaks[s]:6.2f} "
                                              f"{predicted[s] / peaks[s]:9.3f}" for s in range(args.pp)), flush=True)


if __name__ == "__main__":
    main()
