"""Predicted vs measured peak memory of long-context layouts on CPU: context-parallel modes, activation offload and the
chunked pipeline.

Each layout trains ``llama-tiny`` (positions extended to 16K) at 8K tokens per sequence for a few steps through the
trainer ``loongforge train`` runs (``loongforge.train.measure`` calls the same ``run_training``, under torchrun +
gloo for more than one process), which records every rank's peak live tensor bytes from the profiler's allocator
events. The prediction is ``loongforge.planner.memory.estimate_memory`` of the layout as the planner describes it
(``Candidate`` with ``cp_mode``/``cp_a2a_size``/``offload_layers``/``seq_chunks``), default coefficients; the run's
overrides are the candidate's own ``parallel_config()`` and offloaded layers, so the measured run is the config the
planner writes.

On the CPU backend host and device are one memory: offloaded activations still count in the measured peak, so an
offloaded layout is compared with the device peak plus what it holds in host memory (``MemoryEstimate.host_bytes``).

    python benchmarks/planner_long_context.py              # 9 layouts, ~20 minutes on 2 shared cores
    python benchmarks/planner_long_context.py --only 0,3

Baseline for the ratios: the memory model's prediction (ratio = predicted / measured; 1.00 is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from loongforge.config import load_config
from loongforge.planner.auto import workload_for
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import estimate_memory
from loongforge.resolve import resolve_model_flavor

SEQ = 8192
CONFIG = f"""
run: {{seed: 1}}
model: {{name: llama-tiny, overrides: {{max_position_embeddings: 16384}}}}
data: {{seq_length: {SEQ}}}
training: {{micro_batch_size: 1, global_batch_size: 1, threads: 1}}
logging: {{interval: 1}}
"""


@dataclass(frozen=True)
class Case:
    """One layout: the planner's candidate (dp=1: every process is a cp rank) and its process count."""

    candidate: Candidate

    @property
    def nproc(self) -> int:
        return self.candidate.world_size

    def overrides(self, num_layers: int) -> list[str]:
        out = [f"parallel.{key}={json.dumps(value)}" for key, value in self.candidate.parallel_config().items()]
        layers = sorted(self.candidate.offloaded_layers(num_layers)) if self.candidate.offload_layers else None
        return out + ([f"training.offload_activations={json.dumps({'layers': layers})}"] if layers else [])


def _case(cp: int = 1, mode: str = "ulysses", a2a: int | None = None, offload: int = 0, pp: int = 1,
          chunks: int = 1) -> Case:
    return Case(Candidate(tp=1, pp=pp, dp=1, cp=cp, cp_mode=mode, cp_a2a_size=a2a, distributed_optimizer=False,
                          offload_layers=offload, seq_chunks=chunks))


CASES = [
    _case(),
    _case(offload=2),
    _case(cp=2, mode="ulysses"),
    _case(cp=2, mode="ring"),
    _case(cp=2, mode="ring", offload=2),
    _case(cp=4, mode="ring"),
    _case(cp=4, mode="hybrid", a2a=2),
    _case(chunks=4),
    _case(pp=2, chunks=8),
]


def measure(config: Path, out: Path, case: Case, overrides: list[str]) -> int:
    """The highest peak over the ranks of one measured run."""
    module = ["-m", "loongforge.train.measure", str(config), str(out), "--time-steps=1", *overrides]
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.nproc)]
                if case.nproc > 1 else [])
    done = subprocess.run([sys.executable, *launcher, *module], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{overrides}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return max(json.loads(p.read_text())["peak_bytes"] for p in out.glob("rank*.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case indices (default: all)")
    args = parser.parse_args()
    cases = [CASES[int(i)] for i in args.only.split(",")] if args.only else CASES
    print(f"llama-tiny, seq {SEQ}, micro-batch 1, fp32, CPU (gloo); ratio = predicted / measured")
    print(f"{'layout':44s} {'n':>2s} {'pred MiB':>9s} {'(host)':>7s} {'meas MiB':>9s} {'ratio':>6s}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "long.yaml"
        config.write_text(CONFIG)
        resolved = load_config(str(config))
        family = resolve_model_flavor(resolved)
        workload = replace(workload_for(resolved, family, "local"), offloaded_layers=frozenset())
        layers = workload.terms().num_layers
        for i, case in enumerate(cases):
            estimate = estimate_memory(workload, case.candidate)
            predicted = estimate.total + estimate.host_bytes  # one memory on CPU (see the module docstring)
            measured = measure(config, root / f"case{i}", case, case.overrides(layers))
            ratios.append(predicted / measured)
            print(f"{case.candidate.describe(layers):44s} {case.nproc:2d} {predicted / 2**20:9.1f} "
                  f"{estimate.host_bytes / 2**20:7.1f} {measured / 2**20:9.1f} {predicted / measured:6.3f}", flush=True)
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"{within}/{len(ratios)} layouts within 15%, max |ratio - 1| {max(abs(r - 1) for r in ratios):.1%}")


if __name__ == "__main__":
    main()
