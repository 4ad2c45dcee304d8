"""Packed rows through attention: the dense block-diagonal mask vs varlen (sequence by sequence), memory and time.

One packed row of ``--seq`` tokens holding ``--segments`` sequences of random lengths (seeded; the same row for both
sides) goes forward and backward through core's attention (:class:`~loongforge.devices.sdpa_attention.SDPAttention`,
fp32, GQA) per step, as the trainer feeds it (:func:`~loongforge.parallel.packed_rows.attend_packed`): **dense** builds
the ``[1, 1, s, s]`` block-diagonal causal mask from the row's ``cu_seqlens`` and attends the whole square through it;
**varlen** builds the layout from ``cu_seqlens`` and attends each sequence alone (no ``s * s`` tensor). Each side of
each case runs in a fresh process of its own, so its peak memory is its own: ``peak`` is the growth of the process's
peak RSS over its RSS once the inputs exist (what the steps add). Sides alternate over ``--rounds``; median step
times are shown, and the largest difference between the sides' outputs and input gradients (the same attention:
rounding only). Usage::

    python benchmarks/packed_attention.py                          # 4K and 8K rows, 8 and 16 sequences
    python benchmarks/packed_attention.py --seq 4096 --segments 8 --rounds 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SIDES = ("dense", "varlen")


def _lengths(seq: int, segments: int, seed: int) -> list[int]:
    """``segments`` random positive lengths that add up to ``seq`` (cuts drawn uniformly, seeded)."""
    import random

    cuts = sorted(random.Random(seed).sample(range(1, seq), segments - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def worker(args: argparse.Namespace) -> None:
    """One side: ``--steps`` timed forward+backward passes after one untimed; a JSON line with the figures."""
    import torch
    from loongforge.devices.sdpa_attention import SDPAttention
    from loongforge.interop.world import standalone_world
    from loongforge.parallel.packed_rows import attend_packed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.set_num_threads(args.threads)
    with standalone_world():
        config = TransformerConfig(num_layers=1, hidden_size=args.heads * args.head_dim,
                                   num_attention_heads=args.heads, num_query_groups=args.groups,
                                   attention_dropout=0.0)
        attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
        generator = torch.Generator().manual_seed(0)
        shape = (args.seq, 1)
        q = torch.randn(*shape, args.heads, args.head_dim, generator=generator, requires_grad=True)
        k = torch.randn(*shape, args.groups, args.head_dim, generator=generator, requires_grad=True)
        v = torch.randn(*shape, args.groups, args.head_dim, generator=generator, requires_grad=True)
        grad_out = torch.randn(args.seq, 1, args.heads * args.head_dim, generator=generator)
        lengths = _lengths(args.seq, args.segments, args.seed)
        cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch = {"tokens": torch.zeros(1, args.seq, dtype=torch.long), "cu_seqlens": cu_seqlens}
        base = _rss()
        times = []
        for step in range(args.steps + 1):
            for x in (q, k, v):
                x.grad = None
            start = time.perf_counter()
            fed = attend_packed(batch, varlen=args.worker == "varlen")
            out = attention(q, k, v, fed.get("attention_mask"), packed_seq_params=fed.get("packed_seq_params"))
            out.backward(grad_out)
            if step:
                times.append(time.perf_counter() - start)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        checksum = [float(out[::97].sum()), *(float(x.grad[::97].sum()) for x in (q, k, v))]
    print(json.dumps({"times": times, "peak": peak, "checksum": checksum, "lengths": lengths}))


def run_side(args: argparse.Namespace, side: str, seq: int, segments: int) -> dict:
    command = [sys.executable, __file__, "--worker", side, "--seq", str(seq), "--segments", str(segments),
               "--steps", str(args.steps), "--threads", str(args.threads), "--heads", str(args.heads),
               "--groups", str(args.groups), "--head-dim", str(args.head_dim), "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} seq {seq} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192], help="row lengths (tokens)")
    parser.add_argument("--segments", type=int, nargs="+", default=[8, 16], help="sequences per row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, sides alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.seq, args.segments = args.seq[0], args.segments[0]
        return worker(args)
    print(f"core attention fwd+bwd, fp32, {args.heads} heads / {args.groups} K/V groups x {args.head_dim}, "
          f"{args.threads} threads, {args.steps} steps x {args.rounds} rounds per side")
    print(f"{'seq':>6} {'segs':>4} | {'dense ms':>9} {'varlen ms':>9} {'speed-up':>8} | "
          f"{'dense MiB':>9} {'varlen MiB':>10} {'mem ratio':>9} | {'max diff':>8}")
    for seq in args.seq:
        for segments in args.segments:
            results: dict[str, list[dict]] = {side: [] for side in SIDES}
            for round_ in range(args.rounds):
                for side in SIDES[:: 1 if round_ % 2 == 0 else -1]:
                    results[side].append(run_side(args, side, seq, segments))
            time_ms = {s: statistics.median(t for r in results[s] for t in r["times"]) * 1e3 for s in SIDES}
            peak = {s: max(r["peak"] for r in results[s]) / 2**20 for s in SIDES}
            diff = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(results["dense"][0]["checksum"],
                                                                       results["varlen"][0]["checksum"], strict=True))
            print(f"{seq:>6} {segments:>4} | {time_ms['dense']:>9.1f} {time_ms['varlen']:>9.1f} "
                  f"{time_ms['dense'] / time_ms['varlen']:>7.2f}x | {peak['dense']:>9.1f} {peak['varlen']:>10.1f} "
                  f"{peak['dense'] / max(peak['varlen'], 1e-9):>8.1f}x | {diff:>8.1e}")


if __name__ == "__main__":
    main()
