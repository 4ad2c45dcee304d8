"""Measure one training run's peak memory and step time per rank (the layout planner's calibration ground truth).

Run under torchrun (or as one process): ``python -m loongforge.train.measure CONFIG OUT_DIR [KEY=VALUE...]``.
It lives with the trainer it runs (the planner, :mod:`loongforge.planner.calibrate`, only reads its numbers), so
the planner does not depend on the training code that depends on it (``parallel: auto``).
Each rank writes ``OUT_DIR/rank<N>.json`` with its pipeline stage, its peak live tensor bytes and the median
step time.

Why the profiler's allocator events: on CPU there is no ``max_memory_allocated``, and the process RSS mixes
the ~360 MB of torch/megatron imports, glibc's retained free lists and untouched pages with what the model
uses. ``torch.profiler`` with ``profile_memory`` records every tensor allocation and free with the running
total of bytes allocated since the profiler started -- exactly the live-tensor peak that the memory model
predicts (and that a GPU's caching allocator reports). Profiling slows the step, so the run is done twice in
one process (sharing one process group): first unprofiled for the step time, then profiled (two steps,
enough for the optimizer state to exist during a forward/backward) for memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def _walk(nodes: list[Any]) -> Any:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _allocation_totals(prof: Any) -> list[int]:
    """Running totals of bytes allocated since the profiler started, in event order."""
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = [n for n in _walk(tree) if n.tag == _EventType.Allocation]
    events.sort(key=lambda n: n.start_time_ns)
    if not events:
        return []
    # The allocator's running total persists across profiler sessions: count from this session's start.
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return [n.extra_fields.total_allocated - start for n in events]


def profiled_peak_bytes(prof: Any) -> int:
    """The highest running total of allocated bytes among a finished profiler's allocation events."""
    return max(_allocation_totals(prof), default=0)


def profiled_live_bytes(prof: Any) -> int:
    """Bytes allocated during profiling and still live when it stopped."""
    totals = _allocation_totals(prof)
    return totals[-1] if totals else 0


def measure(config_path: str, out_dir: str, overrides: list[str], time_steps: int = 4, memory_steps: int = 2) -> dict:
    """Train twice (timing, then memory under the profiler) and write this rank's numbers."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from loongforge.config import load_config
    from loongforge.train.run import run_training

    if "RANK" in os.environ and not dist.is_initialized():
        # One process group for both runs: run_training then leaves it up (a second rendezvous would hang).
        dist.init_process_group("gloo")
    out = Path(out_dir)
    common = ["checkpoint.save_at_end=false", "checkpoint.resume=never", "logging.progress=false",
              "logging.tensorboard=false", "training.sample_tokens=0", *overrides]
    step_time = None  # --time-steps 0: memory only (a run whose steps take many minutes)
    if time_steps:
        timed = load_config(config_path, [*common, f"training.steps={time_steps}", f"run.output_dir={out / 'time'}"])
        run_training(timed)
        rows = [json.loads(line) for line in (out / "time" / "metrics.jsonl").read_text().splitlines()]
        step_time = statistics.median(row["step_time"] for row in rows[1:] or rows)
    memory = load_config(config_path, [*common, f"training.steps={memory_steps}", "logging.jsonl=false",
                                       f"run.output_dir={out / 'memory'}"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_training(memory)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # megatron's rank order puts pipeline stages outermost (a parallel: auto config reports stage 0)
    result = {"rank": rank, "stage": rank // (world // memory.parallel.pp), "peak_bytes": profiled_peak_bytes(prof),
              "step_time": step_time}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m loongforge.train.measure", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("out_dir", help="directory for the measured runs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for train")
    parser.add_argument("--time-steps", type=int, default=4,
                        help="steps of the timed run (the first is left out); 0: no timed run")
    parser.add_argument("--memory-steps", type=int, default=2,
                        help="steps of the profiled run (2: the optimizer state exists during the second)")
    args = parser.parse_intermixed_args(argv)
    measure(args.config, args.out_dir, args.overrides, time_steps=args.time_steps, memory_steps=args.memory_steps)


if __name__ == "__main__":
    main(sys.argv[1:])
