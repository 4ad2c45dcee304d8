"""MoE all-to-all overlap on CPU/gloo at ep=2: step time with and without ``parallel.moe_a2a_overlap``.

The script starts itself under torchrun (2 gloo processes, which hold the process group, so the trainer runs several
times in them without paying the start-up again) and trains ``--model`` at ep=2 alternately without and with the
overlap (per-local-expert chunked exchange, :mod:`loongforge.parallel.moe_overlap`) for ``--rounds`` rounds. It
prints the median step time of each side (the first ``--warmup`` steps left out), whether the two sides' losses are
bitwise equal, and from the recorded schedule how often an exchange was still running (gloo had not finished it)
when an expert started computing: the overlap that actually happened. Usage::

    python benchmarks/moe_a2a_overlap.py                        # qwen3-moe-tiny, seq 256, 2 rounds of 8 steps
    python benchmarks/moe_a2a_overlap.py --seq 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-moe-tiny")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="rows per micro-batch (2 micro-batches per rank)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set when started under torchrun: the output folder
    return parser.parse_args()


def _train(args: argparse.Namespace, out: Path, overlap: bool) -> tuple[list[dict], list]:
    """One run's metrics rows and this rank's schedule trace."""
    from loongforge import load_config
    from loongforge.parallel import moe_overlap
    from loongforge.train.run import run_training

    moe_overlap.schedule_trace = []
    run_training(load_config(None, [
        f"run.output_dir={out}", f"model.name={args.model}", f"data.seq_length={args.seq}", "run.seed=1",
        f"training.steps={args.steps}", f"training.micro_batch_size={args.batch}",
        f"training.global_batch_size={args.batch * 4}", "training.threads=1", "training.sample_tokens=0",
        "parallel.ep=2", f"parallel.moe_a2a_overlap={str(overlap).lower()}", "checkpoint.save_at_end=false",
        "checkpoint.resume=never", "logging.progress=false", "logging.tensorboard=false", "logging.interval=1000"]),
        device="cpu")
    trace, moe_overlap.schedule_trace = moe_overlap.schedule_trace, None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], trace


def _in_flight(trace: list) -> tuple[int, int]:
    """(expert computes that started while an issued exchange was still running, expert computes)."""
    starts = [outstanding for event, _, outstanding in trace if event == "compute_start"]
    return sum(any(not finished for _, _, finished in o) for o in starts), len(starts)


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    times: dict[str, list[float]] = {"off": [], "on": []}
    losses: dict[str, list[float]] = {}
    running, computes = 0, 0
    for round_ in range(args.rounds):
        for side in ("off", "on")[:: 1 if round_ % 2 == 0 else -1]:
            rows, trace = _train(args, Path(args.worker) / f"{side}-{round_}", side == "on")
            times[side] += [row["step_time"] for row in rows if row["step"] > args.warmup]
            losses[side] = [row["loss"] for row in rows]
            running, computes = (running + _in_flight(trace)[0], computes + _in_flight(trace)[1])
    if dist.get_rank() == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"{args.model}, ep=2 (gloo, 2 processes), seq {args.seq}, micro-batch {args.batch}, "
              f"{args.steps} steps x {args.rounds} rounds per side")
        print(f"median step time: no overlap {off * 1000:.1f} ms, overlap {on * 1000:.1f} ms, "
              f"speed-up {off / on:.3f}x")
        print(f"losses bitwise equal: {losses['on'] == losses['off']}")
        print(f"expert computes started while an exchange was still running (rank 0): {running} of {computes}")
    dist.destroy_process_group()


def main() -> None:
    args = _arguments()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                   *sys.argv[1:], "--worker", tmp]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"benchmark failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith(("[loongforge]", "step "))))


if __name__ == "__main__":
    main()
