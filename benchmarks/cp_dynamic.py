"""Dynamic context parallelism on a mixed-length corpus: step time with and without ``parallel.dynamic_cp_threshold``.

The same packed SFT run (``shipped-chat``: 400 conversations of 50 to 279 byte tokens, packed best-fit into rows of
``--seq`` tokens) trains at cp=2 twice per round through the CLI (``loongforge train --nproc 2``): every micro-batch
split per sequence (threshold 0), and dynamic CP (``--threshold``), where a micro-batch none of whose
conversations is longer than the threshold is dealt whole to the two ranks and attended without any exchange.
Sides alternate over ``--rounds``; the median step time of each side is shown (the first ``--warmup`` steps left
out), with the share of micro-batches dynamic CP left whole and the largest relative loss difference between the
sides (the two are the same computation, so it is rounding). Usage::

    python benchmarks/cp_dynamic.py                          # llama-tiny, 2 rounds of 12 steps, ulysses
    python benchmarks/cp_dynamic.py --mode ring --rounds 3 --steps 20
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


def _config_text(args: argparse.Namespace, out: Path) -> str:
    return f"""
run: {{output_dir: {out}, seed: 1}}
model: {{name: {args.model}}}
data: {{dataset: shipped-chat, seq_length: {args.seq}, pack: true}}
optimizer: {{lr: 3.0e-4}}
scheduler: {{warmup_steps: 0, decay: constant}}
training: {{phase: sft, steps: {args.steps}, micro_batch_size: {args.batch}, global_batch_size: {args.batch * 2},
           threads: 1, sample_tokens: 0}}
checkpoint: {{save_at_end: false, resume: never, keep_last: 0}}
logging: {{interval: 1000, progress: false, tensorboard: false}}
"""


def run_side(args: argparse.Namespace, root: Path, name: str, threshold: int) -> dict[int, dict]:
    """One training run at cp=2; its metrics rows by step."""
    out = root / name
    config = root / f"{name}.yaml"
    config.write_text(_config_text(args, out))
    command = [sys.executable, "-m", "loongforge.cli", "train", str(config), "--nproc", "2", "parallel.cp=2",
               f"parallel.cp_mode={args.mode}", f"parallel.dynamic_cp_threshold={threshold}"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--mode", default="ulysses", choices=["ulysses", "ring"])
    parser.add_argument("--seq", type=int, default=512, help="packed row length (tokens)")
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--threshold", type=int, default=160, help="dynamic CP's longest unsplit sequence")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"split": [], "dynamic": []}
    whole, losses = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for round_ in range(args.rounds):
            for side, threshold in (("split", 0), ("dynamic", args.threshold))[:: 1 if round_ % 2 == 0 else -1]:
                rows = run_side(args, root, f"{side}-{round_}", threshold)
                times[side] += [row["step_time"] for step, row in rows.items() if step > args.warmup]
                losses[side] = {step: row["loss"] for step, row in rows.items()}
                whole = sum(row.get("cp_whole_micro_batches", 0) for row in rows.values()) if threshold else whole
    split, dynamic = statistics.median(times["split"]), statistics.median(times["dynamic"])
    difference = max(abs(losses["dynamic"][s] - loss) / abs(loss) for s, loss in losses["split"].items())
    print(f"{args.model}, cp=2 {args.mode}, rows of {args.seq}, {args.steps} steps x {args.rounds} rounds per side")
    print(f"micro-batches dealt whole (threshold {args.threshold}): {whole} of {args.steps * 2} per run")
    print(f"median step time: split {split * 1000:.1f} ms, dynamic {dynamic * 1000:.1f} ms, "
          f"speed-up {split / dynamic:.2f}x")
    print(f"largest relative loss difference between the sides: {difference:.2g}")


if __name__ == "__main__":
    main()
