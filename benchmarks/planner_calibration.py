"""Planner calibration on CPU: predicted vs measured peak memory and step time for several layouts.

Each layout trains a tiny model for a few steps through the real trainer (``loongforge.train.measure``
under torchrun, gloo), measuring every rank's peak live tensor bytes (profiler allocator events) and the
median step time. The script prints, per layout, the prediction with the default coefficients, the
measurement and the relative error, then the Spearman rank correlation of predicted vs measured step times
among layouts with the same process count (the planner only ever compares layouts for one device count),
and with ``--write FILE`` fits the coefficients and writes a calibration file that ``loongforge plan
--calibration FILE`` reads.

    python benchmarks/planner_calibration.py                      # all layouts (~10 minutes on 2 cores)
    python benchmarks/planner_calibration.py --only 0,3 --write calib.json

Baseline for the ratios: the memory model's own prediction (ratio measured/predicted; 1.00 is exact).
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

from loongforge.models.registration import all_flavors
from loongforge.planner.calibrate import Calibration, Measurement, fit_memory, fit_time, save_calibration, spearman
from loongforge.planner.hardware import CPU_DEFAULTS, GIB, ClusterSpec, cpu_device_flops
from loongforge.planner.layouts import Candidate, RecomputePlan
from loongforge.planner.memory import Workload, estimate_memory
from loongforge.planner.timing import estimate_time

CONFIG = """
run: {seed: 1}
model: {name: MODEL}
data: {seq_length: SEQ}
training: {micro_batch_size: 1, global_batch_size: GBS, threads: 1}
logging: {interval: 1}
"""
SEQ, GBS = 256, 8


@dataclass(frozen=True)
class Case:
    model: str
    nproc: int
    candidate: Candidate

    def overrides(self) -> list[str]:
        c = self.candidate
        out = [f"parallel.tp={c.tp}", f"parallel.pp={c.pp}",
               f"parallel.sequence_parallel={str(c.sequence_parallel).lower()}",
               f"parallel.distributed_optimizer={str(c.distributed_optimizer).lower()}",
               f"training.micro_batch_size={c.micro_batch_size}"]
        rc = c.recompute.as_config()
        if rc is not None:
            out.append(f"model.recompute={json.dumps(rc)}")
        return out


def _case(model: str, tp: int = 1, pp: int = 1, dp: int = 1, mbs: int = 4, sp: bool = False, distopt: bool = False,
          rc: RecomputePlan | None = None) -> Case:
    m = GBS // (mbs * dp)
    cand = Candidate(tp=tp, pp=pp, dp=dp, etp=tp, sequence_parallel=sp, distributed_optimizer=distopt,
                     micro_batch_size=mbs, num_microbatches=m, recompute=rc or RecomputePlan())
    return Case(model, tp * pp * dp, cand)


CASES = [
    _case("llama-tiny", mbs=4),
    _case("llama-tiny", mbs=8, rc=RecomputePlan("selective", ("mlp",))),
    _case("llama-tiny", mbs=8, rc=RecomputePlan("full", num_layers=4)),
    _case("llama-tiny", tp=2, sp=True, mbs=4),
    _case("llama-tiny", pp=2, mbs=2),
    _case("llama-tiny", dp=2, mbs=4, distopt=True),
    _case("llama-tiny", dp=2, mbs=2, distopt=True, rc=RecomputePlan("full", num_layers=2)),
    _case("llama-tiny", tp=2, pp=2, sp=True, mbs=2),
    _case("llama-tiny", tp=2, dp=2, sp=True, mbs=4, rc=RecomputePlan("full", num_layers=4)),
    _case("qwen3-tiny", mbs=4),
    _case("qwen3-tiny", tp=2, sp=True, mbs=8, rc=RecomputePlan("selective", ("core_attn", "mlp"))),
]


def cpu_cluster(nproc: int) -> ClusterSpec:
    """The CPU 'cluster' of ``nproc`` processes on this host: they share the cores (one thread each)."""
    flops = cpu_device_flops(nproc, os.cpu_count() or 1)
    return ClusterSpec(num_devices=nproc, device_memory=16 * GIB, ranks_per_node=nproc,
                       **{**CPU_DEFAULTS, "device_flops": flops}, name="cpu")


def run_case(case: Case, root: Path, time_steps: int) -> dict:
    """Launch the measurement; return ``{"peak_bytes": max over ranks, "per_rank": [...], "step_time": s}``."""
    out = root / f"{case.model}-{case.nproc}-{abs(hash(case.candidate))}"
    config = root / f"{out.name}.yaml"
    config.write_text(CONFIG.replace("MODEL", case.model).replace("SEQ", str(SEQ)).replace("GBS", str(GBS)))
    module = ["-m", "loongforge.train.measure", str(config), str(out), f"--time-steps={time_steps}",
              *case.overrides()]
    if case.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.nproc),
               *module]
    else:
        cmd = [sys.executable, *module]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode:
        raise RuntimeError(f"{case}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"peak_bytes": max(r["peak_bytes"] for r in ranks), "per_rank": ranks,
            "step_time": ranks[0]["step_time"]}


def measurement(case: Case, result: dict) -> Measurement:
    workload = Workload(all_flavors()[case.model], SEQ, "fp32", kernels="local")
    return Measurement(workload, case.candidate, cpu_cluster(case.nproc), result["peak_bytes"], result["step_time"])


def report(measurements: list[Measurement], calibration: Calibration) -> dict:
    """Print the comparison table; return the summary numbers."""
    print(f"{'layout':58s} {'n':>2s} {'pred MiB':>9s} {'meas MiB':>9s} {'err':>7s} {'pred s':>8s} {'meas s':>8s}")
    errors, groups = [], {}
    for m in measurements:
        pred = estimate_memory(m.workload, m.candidate, calibration.memory).total
        t = estimate_time(m.workload, m.candidate, m.cluster, calibration.time).total
        err = (pred - m.peak_bytes) / m.peak_bytes
        errors.append(err)
        groups.setdefault(m.cluster.num_devices, []).append((t, m.step_time))
        name = f"{m.workload.flavor.family} {m.candidate.describe(m.workload.flavor.num_layers)}"
        print(f"{name:58s} {m.cluster.num_devices:2d} {pred / 2**20:9.1f} {m.peak_bytes / 2**20:9.1f} {err:+7.1%} "
              f"{t:8.3f} {m.step_time:8.3f}")
    within = sum(abs(e) <= 0.15 for e in errors)
    print(f"memory: {within}/{len(errors)} layouts within 15%, max |error| {max(abs(e) for e in errors):.1%}")
    rhos = {}
    for n, pairs in sorted(groups.items()):
        if len(pairs) > 1:
            rhos[n] = spearman([p for p, _ in pairs], [q for _, q in pairs])
            print(f"step time, {n} process(es): Spearman rho {rhos[n]:+.2f} over {len(pairs)} layouts")
    allpairs = [pair for pairs in groups.values() for pair in pairs]
    overall = spearman([p for p, _ in allpairs], [q for _, q in allpairs])
    print(f"step time, all layouts: Spearman rho {overall:+.2f}")
    return {"within_15pct": within, "layouts": len(errors), "errors": errors, "rho_by_nproc": rhos, "rho": overall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case indices (default: all)")
    parser.add_argument("--write", help="fit coefficients and write this calibration file")
    parser.add_argument("--results", help="reuse/save raw measurements in this JSON file")
    parser.add_argument("--time-steps", type=int, default=6, help="steps of each timed run (default 6)")
    args = parser.parse_args()
    cases = [CASES[int(i)] for i in args.only.split(",")] if args.only else CASES
    cache = json.loads(Path(args.results).read_text()) if args.results and Path(args.results).exists() else {}
    measurements = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            key = f"{case.model}|{case.nproc}|{case.candidate}"
            if key not in cache:
                cache[key] = run_case(case, Path(tmp), args.time_steps)
                if args.results:
                    Path(args.results).write_text(json.dumps(cache, indent=1))
            measurements.append(measurement(case, cache[key]))
    print("== default coefficients ==")
    report(measurements, Calibration())
    if args.write:
        memory = fit_memory(measurements)
        time = fit_time(measurements)
        fitted = Calibration(memory, replace(time), source=f"benchmarks/planner_calibration.py, {len(cases)} layouts")
        save_calibration(fitted, args.write)
        print(f"== fitted coefficients ({args.write}): {fitted.to_json()} ==")
        report(measurements, fitted)


if __name__ == "__main__":
    main()
