"""Wan 2.2 A14B's two experts both on the device vs one at a time (``task.experts_resident``): memory and swaps.

Each mode trains ``wan-tiny-experts`` widened to ``--dim`` / ``--layers`` for ``--steps`` steps with an EMA
(``task.ema``) and ``task.expert_window`` ``--window``, in a fresh process of its own, and reports:

- ``device_mib``: the largest, over the step ends, of the experts' weights, AdamW moments and EMA averages that are on
  the device. On the CPU "device" and host are one memory, so the run uses a counting backend (the CPU backend that
  remembers the host buffers it hands out; what is not in one counts as on the device); on an accelerator the backend's
  own allocator peak is reported beside it (``peak_allocated_mib``);
- ``peak_allocated_mib``: the backend's ``memory_stats()["peak_allocated"]`` (process RSS on the CPU, where host
  buffers and device copies are one memory, so one-resident costs *more* there: it is the accelerator's number);
- ``swaps``, ``expert_changes`` (changes of trained expert between consecutive steps) and the wall time.

Usage::

    python benchmarks/wan_experts_resident.py                        # d256, 4 layers, 16 steps, window 4
    python benchmarks/wan_experts_resident.py --dim 512 --layers 8 --steps 8 --window 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKING = "cpu-host-tracking"


def _child(args: argparse.Namespace) -> dict:
    import torch
    from loongforge import hookimpl, load_config
    from loongforge.devices.cpu import CPUBackend
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    host_storages: set[int] = set()

    class HostTracking(CPUBackend):
        """The CPU backend, remembering the host buffers it hands out (what is not one is on the "device")."""

        name = TRACKING

        def host_empty_strided(self, size, stride, dtype):
            buffer = super().host_empty_strided(size, stride, dtype)
            host_storages.add(buffer.untyped_storage().data_ptr())
            return buffer

    class Probe:
        def __init__(self) -> None:
            self.device_bytes, self.experts, self.swaps, self.peak = 0, [], 0, 0

        @hookimpl
        def loongforge_register_devices(self, registry):
            registry.register(TRACKING, HostTracking)

        @hookimpl
        def loongforge_on_step_end(self, trainer, step, metrics):
            task, model, optimizer = trainer.engine.task, trainer.model, trainer.optimizer
            tensors = []
            for name in ("high", "low"):
                params = list(model.expert(name).parameters())
                tensors += [p.data for p in params]
                tensors += [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
                tensors += list((task.ema.shadows(name) or {}).values())
            on_device = [t for t in tensors if t.device.type != "cpu"
                         or t.untyped_storage().data_ptr() not in host_storages]
            self.device_bytes = max(self.device_bytes, sum(t.nbytes for t in on_device))
            self.experts.append(task.trained_expert)
            self.swaps = 0 if task.residency is None else task.residency.swaps
            self.peak = trainer.backend.memory_stats()["peak_allocated"]

    probe = Probe()
    get_host().register(probe, "resident-benchmark")
    dim = args.dim
    with tempfile.TemporaryDirectory() as out:
        config = load_config(str(ROOT / "configs" / "diffusion-moving-squares.yaml"), [
            f"run.output_dir={out}", "model.name=wan-tiny-experts",
            f"model.overrides={{dim: {dim}, ffn_dim: {4 * dim}, num_heads: {dim // 16}, num_layers: {args.layers}}}",
            f"training.steps={args.steps}", "training.micro_batch_size=2", "task.samples=16", "task.sample={videos: 0}",
            "task.ema={decay: 0.9}", f"task.experts_resident={args.mode}", f"task.expert_window={args.window}",
            "task.flow_matching={shift: 3.0}", "scheduler.warmup_steps=0", "checkpoint.interval=0",
            "logging.progress=false", "logging.tensorboard=false", f"training.threads={args.threads}"])
        start = time.perf_counter()
        run_training(config, device=args.device or None)
        wall = time.perf_counter() - start
    changes = sum(a != b for a, b in pairwise(probe.experts))
    return {"mode": args.mode, "device_mib": probe.device_bytes / 2**20, "peak_allocated_mib": probe.peak / 2**20,
            "swaps": probe.swaps, "expert_changes": changes, "steps": args.steps, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--window", type=int, default=4, help="task.expert_window")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="", help=f"device backend (default: {TRACKING} on a CPU-only host)")
    parser.add_argument("--mode", choices=("both", "one"), help=argparse.SUPPRESS)  # a child process's side
    args = parser.parse_args()
    if args.mode:
        if not args.device:
            import torch

            args.device = "" if torch.cuda.is_available() else TRACKING
        print(json.dumps(_child(args)))
        return
    rows = []
    for mode in ("both", "one"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True, text=True,
                              check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'mode':<6}{'device MiB':>12}{'peak_allocated MiB':>20}{'swaps':>7}{'changes':>9}{'steps':>7}{'wall s':>8}")
    for row in rows:
        print(f"{row['mode']:<6}{row['device_mib']:>12.2f}{row['peak_allocated_mib']:>20.1f}{row['swaps']:>7}"
              f"{row['expert_changes']:>9}{row['steps']:>7}{row['wall_s']:>8.2f}")
    print(f"device memory one/both: {rows[1]['device_mib'] / rows[0]['device_mib']:.3f}")


if __name__ == "__main__":
    main()
