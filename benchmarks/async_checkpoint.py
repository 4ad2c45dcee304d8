"""Synchronous vs background checkpoint saves (``checkpoint.async_save``): how long a save blocks the training loop.

The same run twice in one invocation -- a quickstart-like decoder widened so that its checkpoint (fp32 weights and
AdamW's two moments) is over 200 MB, trained on the CPU with a checkpoint every ``--interval`` steps -- once saving
synchronously and once in the background, each side in a fresh worker process, sides alternating over ``--rounds``
(medians are shown: on a shared machine a synchronous save's disk writes vary several-fold).
Both runs use the same config file and output directory (moved aside in between), so their checkpoints can be
compared file by file. Usage::

    python benchmarks/async_checkpoint.py                       # 3 saves per side, d512 x 6 layers (~230 MB)
    python benchmarks/async_checkpoint.py --saves 5 --layers 8 --threads 2

**Stall** is the wall time the loop is kept from training by saving: a lifecycle hook stamps the end of every step,
and the time between two stamps that is not the second step's own compute (its ``step_time``) is the loop's
overhead at that boundary -- the save itself for a synchronous save; the snapshot (host copy, planning, small
files), the done-polls and the commit for a background one. Per save: the summed overhead minus what the same
boundaries cost without a save (the median boundary), divided by the saves. The training steps after a background
save share the CPU with its writer thread (writing, fsync, two sha256 passes); ``mean step`` shows what that costs
next to the synchronous run's steps.
``--tail`` steps after the last save leave the background writer time to finish; what the end of training still
waits for is shown as ``end wait``.

Identity: every file of every checkpoint is compared byte by byte, except that ``config.yaml`` records the switch
itself and ``metadata.json`` the time of the save (both are compared with those two values left out).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SIDES = {"sync": "false", "background": "true"}


def _config_text(args: argparse.Namespace, out: Path) -> str:
    return f"""
run: {{output_dir: {out}, seed: 1}}
model:
  name: llama-tiny
  overrides: {{num_layers: {args.layers}, hidden_size: {args.hidden}, ffn_hidden_size: {args.ffn}}}
data: {{dataset: shipped-corpus, seq_length: {args.seq}}}
optimizer: {{lr: 3.0e-4, weight_decay: 0.1, grad_clip: 1.0}}
scheduler: {{warmup_steps: 0, decay: constant}}
training: {{steps: {args.saves * args.interval + args.tail}, micro_batch_size: {args.batch}, threads: {args.threads},
           precision: fp32, sample_tokens: 0}}
checkpoint: {{interval: {args.interval}, keep_last: 0, save_at_end: false}}
logging: {{interval: 1000, progress: false, tensorboard: false}}
"""


def worker(config: str, async_save: str) -> dict:
    """Train once; return each step's end time and compute time, and when training ended."""
    from loongforge import hookimpl
    from loongforge.config import load_config
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    ends: list[float] = []
    step_times: list[float] = []
    finished: list[float] = []

    class Stamps:
        @hookimpl
        def loongforge_on_step_end(self, metrics):
            ends.append(time.perf_counter())
            step_times.append(metrics["step_time"])

        @hookimpl
        def loongforge_on_train_end(self):
            finished.append(time.perf_counter())

    get_host().register(Stamps(), "benchmark-stamps")
    run_training(load_config(config, [f"checkpoint.async_save={async_save}"]))
    return {"ends": ends, "step_times": step_times, "train_end": finished[0]}


def run_side(side: str, config: Path) -> dict:
    command = [sys.executable, __file__, "--worker", str(config), SIDES[side]]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise SystemExit(f"{side} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def stall_per_save(result: dict, interval: int) -> tuple[float, float]:
    """(stall per save, mean step time after the first) of one run, from its step-end stamps (module docstring)."""
    ends, compute = result["ends"], result["step_times"]
    overhead = [ends[i + 1] - ends[i] - compute[i + 1] for i in range(len(ends) - 1)]  # boundary after step i+1
    saves = sum(1 for i in range(len(overhead)) if (i + 1) % interval == 0)
    quiet = statistics.median(o for i, o in enumerate(overhead) if (i + 1) % interval != 0)
    return (sum(overhead) - quiet * len(overhead)) / saves, statistics.mean(compute[1:])


def compare_checkpoints(sync_root: Path, background_root: Path) -> tuple[int, int]:
    """Assert that the two runs' checkpoints hold the same files with the same bytes; return (checkpoints, bytes)."""
    names = sorted(p.name for p in sync_root.glob("step-*"))
    assert names and names == sorted(p.name for p in background_root.glob("step-*")), (names, background_root)
    total = 0
    for name in names:
        a, b = sync_root / name, background_root / name
        files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
        assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()), name
        for file in files:
            if file in ("config.yaml", "metadata.json", "manifest.json"):
                continue
            assert filecmp.cmp(a / file, b / file, shallow=False), f"{name}/{file} differs"
            total += (a / file).stat().st_size
        meta = [json.loads((d / "metadata.json").read_text()) for d in (a, b)]
        for recorded in meta:
            del recorded["saved_at"]
        assert meta[0] == meta[1], f"{name}/metadata.json differs beyond saved_at"
        configs = [yaml.safe_load((d / "config.yaml").read_text()) for d in (a, b)]
        assert [c["checkpoint"].pop("async_save") for c in configs] == [False, True]
        assert configs[0] == configs[1], f"{name}/config.yaml differs beyond checkpoint.async_save"
        manifests = [json.loads((d / "manifest.json").read_text())["files"] for d in (a, b)]
        for entries in manifests:
            del entries["config.yaml"], entries["metadata.json"]
        assert manifests[0] == manifests[1], f"{name}/manifest.json differs"
    return len(names), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per side")
    parser.add_argument("--interval", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--tail", type=int, default=3, help="steps after the last checkpoint (< --interval)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    if not 0 < args.tail < args.interval:
        parser.error("--tail must be between 1 and --interval - 1 (a save at the last step is not between steps)")

    with tempfile.TemporaryDirectory(prefix="async-ckpt-bench-") as tmp:
        base = Path(tmp)
        config = base / "run.yaml"
        config.write_text(_config_text(args, base / "out"))
        samples: dict[str, list[tuple[float, float, float]]] = {side: [] for side in SIDES}
        for round_index in range(args.rounds):
            for side in (SIDES if round_index % 2 == 0 else reversed(list(SIDES))):
                result = run_side(side, config)
                stall, step = stall_per_save(result, args.interval)
                samples[side].append((stall, step, result["train_end"] - result["ends"][-1]))
                print(f"round {round_index + 1} {side:10s} stall/save {stall:7.3f} s  mean step {step:6.3f} s",
                      flush=True)
                kept = base / f"{side}-{round_index}"
                shutil.move(base / "out", kept)
        ckpt_bytes = sum(p.stat().st_size for p in (base / "sync-0/checkpoints").glob("step-*/**/*") if p.is_file())
        count, compared = compare_checkpoints(base / "sync-0/checkpoints", base / "background-0/checkpoints")

    size_mb = ckpt_bytes / count / 1e6
    print(f"\nllama-tiny widened: {args.layers} layers, d{args.hidden}, ffn {args.ffn}; checkpoint {size_mb:.0f} MB; "
          f"{args.saves} saves every {args.interval} steps, batch {args.batch} x seq {args.seq}, {args.threads} "
          f"thread(s), fp32, {args.rounds} round(s)")
    print(f"{'':12s}{'stall/save s':>14s}{'mean step s':>13s}{'end wait s':>12s}")
    medians = {}
    for side, rows in samples.items():
        stall, step, end = (statistics.median(r[i] for r in rows) for i in range(3))
        medians[side] = stall
        print(f"{side:12s}{stall:14.3f}{step:13.3f}{end:12.3f}")
    print(f"\nidentical files: {count} checkpoints, {compared / 1e6:.0f} MB compared byte by byte (config.yaml and "
          "metadata.json up to checkpoint.async_save and saved_at)")
    print(f"ratio sync / background stall per save: {medians['sync'] / medians['background']:.1f}x")


if __name__ == "__main__":
    main()
