"""How closely each parallel layout reproduces the one-process quickstart run, step by step.

Trains ``configs/quickstart.yaml`` (``llama-tiny``, sequence 256, fp32) for ``--steps`` steps once per layout
through the real CLI (``loongforge train --nproc N``) with the same seed, data and global batch (16 sequences:
the one-process reference accumulates 2 micro-batches of 8), and prints, per layout, the largest relative
difference from the reference in the per-step loss and gradient norm, and the difference at the last step.
fp32 sums in a different order on each layout, so the differences are rounding that grows with training; they
are the figures docs/parallelism.md quotes.

    python benchmarks/layout_parity.py [--steps 50] [--layouts dp2 tp2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

#: layout name -> (processes, overrides)
LAYOUTS = {
    # the noise floor: one process, the same 16 sequences as 4 micro-batches of 4 (only the summation order
    # of the gradient accumulation differs from the reference)
    "1proc-mbs4": (1, ["training.micro_batch_size=4"]),
    "dp2": (2, []),
    "dp2-distopt": (2, ["parallel.distributed_optimizer=true"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}
COMMON = ["training.micro_batch_size=8", "training.global_batch_size=16", "training.sample_tokens=0",
          "checkpoint.save_at_end=false", "checkpoint.interval=0", "checkpoint.resume=never",
          "logging.progress=false", "logging.tensorboard=false", "training.threads=1"]


def train(out: Path, steps: int, nproc: int, overrides: list[str]) -> dict[int, dict]:
    """One CLI run; its metrics rows by step."""
    cmd = [sys.executable, "-m", "loongforge.cli", "train", str(QUICKSTART), f"run.output_dir={out}",
           f"training.steps={steps}", "logging.interval=1", *COMMON, *overrides]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"layout_parity: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def relative(rows: dict[int, dict], reference: dict[int, dict], key: str) -> list[float]:
    return [abs(rows[s][key] - reference[s][key]) / abs(reference[s][key]) for s in sorted(reference)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        reference = train(Path(tmp) / "reference", args.steps, 1, [])
        print(f"quickstart, {args.steps} steps, global batch 16 x 256 tokens, fp32; reference: one process, "
              f"final loss {reference[args.steps]['loss']:.4f}\n")
        print(f"{'layout':<12} {'procs':>5} {'max rel loss':>13} {'max rel grad norm':>18} "
              f"{'last-step loss':>15} {'last-step grad norm':>20}")
        for name in args.layouts:
            nproc, overrides = LAYOUTS[name]
            rows = train(Path(tmp) / name, args.steps, nproc, overrides)
            loss, grad = relative(rows, reference, "loss"), relative(rows, reference, "grad_norm")
            print(f"{name:<12} {nproc:>5} {max(loss):>13.1e} {max(grad):>18.1e} {loss[-1]:>15.1e} {grad[-1]:>20.1e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
