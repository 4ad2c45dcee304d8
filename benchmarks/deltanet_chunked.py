"""The chunked gated delta rule (Qwen3-Next's Gated DeltaNet op) vs the per-token recurrence, forward + backward on
CPU.

Both are :mod:`loongforge.models.qwen3_next.deltanet`'s pure-torch functions on the same inputs (q, k L2-normalised in
the op, decays ``g`` in [-2, 0), ``beta`` in (0, 1), an initial state, the final state returned): ``recurrent`` runs
``T`` sequential state updates, ``chunked`` solves each 64-token chunk at once and runs ``T / 64`` state updates. For
each sequence length the script checks that the two agree (outputs and input gradients within 1e-4), then prints the
median forward+backward seconds of ``--repeats`` runs after one warm-up, the bytes autograd saves for backward (the
activation memory a training step holds; storages counted once), the step's peak memory (how far the resident set
grows during one step, in a fresh process whose allocator maps every tensor of 16 KiB or more on its own, so freed
memory leaves the resident set; Linux), and the ratios recurrent / chunked. Usage::

    python benchmarks/deltanet_chunked.py                         # seq 1024 2048 4096, 1 x 4 heads of 64
    python benchmarks/deltanet_chunked.py --seq 512 --heads 8 --dim 128 --threads 2

Threads are set with ``--threads`` (default 1), so the numbers do not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from loongforge.models.qwen3_next.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule

RULES = {"chunked": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}


def inputs(args: argparse.Namespace, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, seq, args.heads)
    tensors = [torch.randn(*shape, args.dim, generator=generator), torch.randn(*shape, args.dim, generator=generator),
               torch.randn(*shape, args.dim, generator=generator), -2 * torch.rand(*shape, generator=generator),
               torch.rand(*shape, generator=generator),
               torch.randn(args.batch, args.heads, args.dim, args.dim, generator=generator) * 0.1]
    return [t.requires_grad_() for t in tensors]


def step(rule: str, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One forward + backward: the output, the input gradients and the bytes saved for backward."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    q, k, v, g, beta, state = tensors
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out, final = RULES[rule](q, k, v, g, beta, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(out.sum() + final.sum(), tensors)
    return out.detach(), [grad.detach() for grad in grads], sum(saved.values())


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_in_this_process(args: argparse.Namespace, rule: str, seq: int) -> float:
    """MiB the resident set grows above its start during one step (after a warm-up), the kernel's high-water mark
    reset first. Meaningful under :data:`MMAP_EVERYTHING`, where every tensor is its own mapping."""
    tensors = inputs(args, seq)
    step(rule, tensors)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mib("VmRSS")
    step(rule, tensors)
    return _status_mib("VmHWM") - before


#: glibc serves allocations of 16 KiB and more with their own mappings, returned to the system when freed, so the
#: resident set follows the live tensor memory (by default small tensors come from a heap that never shrinks).
MMAP_EVERYTHING = {"MALLOC_MMAP_THRESHOLD_": "16384", "MALLOC_TOP_PAD_": "0", "MALLOC_TRIM_THRESHOLD_": "0"}


def peak_mib(args: argparse.Namespace, rule: str, seq: int) -> float:
    """The step's peak memory, measured in a fresh process (Linux)."""
    command = [sys.executable, __file__, "--peak-of", rule, str(seq), "--batch", str(args.batch), "--heads",
               str(args.heads), "--dim", str(args.dim), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, **MMAP_EVERYTHING})
    return float(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, rule: str, seq: int) -> dict:
    """One (rule, length): median seconds after a warm-up, bytes saved for backward, peak allocated bytes."""
    tensors = inputs(args, seq)
    _, _, saved = step(rule, tensors)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step(rule, tensors)
        seconds.append(time.perf_counter() - start)
    return {"seconds": statistics.median(seconds), "saved_mib": saved / 2**20, "peak_mib": peak_mib(args, rule, seq)}


def check(args: argparse.Namespace, seq: int) -> float:
    """The largest difference between the two rules' outputs and gradients at ``seq`` tokens."""
    tensors = inputs(args, seq)
    (out_a, grads_a, _), (out_b, grads_b, _) = (step(rule, tensors) for rule in RULES)
    return max((a - b).abs().max().item() for a, b in zip([out_a, *grads_a], [out_b, *grads_b], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="key and value head dimension")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peak-of", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_of:
        print(peak_in_this_process(args, args.peak_of[0], int(args.peak_of[1])))
        return
    print(f"gated delta rule fwd+bwd on CPU: batch {args.batch}, {args.heads} heads, d_k = d_v = {args.dim}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'seq':>6} {'rule':>10} {'time s':>9} {'saved MiB':>10} {'peak MiB':>9}   max |diff|")
    for seq in args.seq:
        diff = check(args, seq)
        if diff > 1e-4:
            raise SystemExit(f"seq {seq}: chunked and recurrent differ by {diff:.2e}")
        results = {}
        for rule in RULES:
            results[rule] = r = measure(args, rule, seq)
            print(f"{seq:>6} {rule:>10} {r['seconds']:>9.3f} {r['saved_mib']:>10.1f} {r['peak_mib']:>9.1f}"
                  + (f"   {diff:.1e}" if rule == "chunked" else ""))
        fast, slow = results["chunked"], results["recurrent"]
        print(f"{seq:>6} {'ratio':>10} {slow['seconds'] / fast['seconds']:>8.1f}x "
              f"{slow['saved_mib'] / fast['saved_mib']:>9.1f}x {slow['peak_mib'] / fast['peak_mib']:>8.1f}x"
              "   (recurrent / chunked)")


if __name__ == "__main__":
    main()
