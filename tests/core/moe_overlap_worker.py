"""Worker for tests/core/test_moe_a2a_overlap.py (one torchrun launch, 2 gloo processes; rank 0 prints one JSON line).

It holds the process group itself, so :func:`loongforge.train.run.run_training` (which then leaves the group alone)
trains twice in the same processes: a small Mixtral at ep=2 (2 local experts per rank) without and with
``parallel.moe_a2a_overlap``, through the real trainer. :data:`loongforge.parallel.moe_overlap.schedule_trace` records
both runs; each rank's trace is gathered to rank 0, which prints the two runs' metrics rows and the traces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from loongforge import load_config
from loongforge.parallel import moe_overlap
from loongforge.train.run import run_training

MODEL = ["model.name=mixtral-tiny", "model.overrides.num_layers=2", "model.overrides.hidden_size=64",
         "model.overrides.ffn_hidden_size=128", "model.overrides.moe_ffn_hidden_size=96"]
TRAINING = ["data.seq_length=32", "optimizer.lr=0.002", "scheduler.warmup_steps=1", "training.steps=3",
            "training.micro_batch_size=2", "training.global_batch_size=8", "training.threads=1", "run.seed=11",
            "parallel.ep=2", "checkpoint.save_at_end=false", "checkpoint.resume=never", "logging.progress=false",
            "logging.tensorboard=false", "logging.interval=1"]


def train(out: Path, *extra: str) -> tuple[list[dict], list]:
    """Metrics rows of one run, and this rank's schedule trace of it."""
    moe_overlap.schedule_trace = []
    run_training(load_config(None, [f"run.output_dir={out}", *MODEL, *TRAINING, *extra]), device="cpu")
    trace, moe_overlap.schedule_trace = moe_overlap.schedule_trace, None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], trace


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    off_rows, off_trace = train(root / "off")
    on_rows, on_trace = train(root / "on", "parallel.moe_a2a_overlap=true")
    traces: list = [None] * dist.get_world_size()
    dist.all_gather_object(traces, {"off": off_trace, "on": on_trace})
    if dist.get_rank() == 0:
        print(json.dumps({"off": off_rows, "on": on_rows, "traces": traces}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
