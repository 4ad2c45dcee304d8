"""DeepSeek sparse attention (DSA) on CPU: the efficient operators vs their dense-masked reference, forward+backward.

One step of each side is what a DSA layer's core attention does in the sparse training phase, from fixed inputs
(the main attention's ``q``/``k``/``v`` in MLA's absorbed form -- ``--heads`` query heads over one shared latent
key/value head, ``--dk``/``--dv`` wide -- and the lightning indexer's queries, keys and head weights):

- ``efficient``: :func:`~loongforge.models.sparse_attention.select_topk` (query blocks, causal keys only),
  :func:`~loongforge.models.sparse_attention.sparse_attention` (gathers the ``--topk`` selected keys per query,
  returns the head-summed probabilities) and the sparse KL loss
  :func:`~loongforge.models.sparse_attention.indexer_kl_loss` (Eq. 4 of the DeepSeek-V3.2 report);
- ``reference``: the dense ``[S, T]`` index scores and ``topk``, the ``[S, T]``-masked softmax attention
  (:func:`~loongforge.models.sparse_attention.sparse_attention_reference`) and
  :func:`~loongforge.models.sparse_attention.indexer_kl_loss_reference`.

then ``(out * w).sum() + kl`` backward (gradients into q, k, v and the indexer tensors). Both sides print the loss
(equal up to rounding, a check that they computed the same thing: the indexer inputs are drawn so that no two
keys tie for a top-k place). Each (side, length) runs in a fresh child
process (glibc malloc tuned as in every LoongForge CPU run, :mod:`loongforge.devices.cpu_malloc`): ``--warmup``
untimed steps, then ``--repeats`` timed ones (median wall-clock seconds reported, and the process's CPU seconds,
which other tenants of a shared host disturb less); memory is the child's peak
RSS (``ru_maxrss``) over its RSS just before the first step -- what one step needs on top of its inputs. Sides
run one after the other, not in lockstep (:mod:`lockstep`): the ratios are far above the host's drift, and two
sides alive at once would share the machine's memory. A reference run whose peak, extrapolated from the largest
length it has run (``x (S / S_prev)^2``: it holds ``[S, S]`` matrices), would exceed ``--max-gib`` is skipped
with the reason printed. Usage::

    python benchmarks/dsa_sparse_attention.py                        # seq 4096 8192 16384, top-k 512
    python benchmarks/dsa_sparse_attention.py --seqs 1024 2048 --repeats 5 --out dsa.json
    python benchmarks/dsa_sparse_attention.py --heads 8 --topk 2048 --max-gib 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("efficient", "reference")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _load() -> str:
    """The 1/5/15-minute load averages: on a shared host, how much others ran meanwhile."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def worker(args: argparse.Namespace) -> dict:
    """One side at one length in this process: the timings, the loss and the memory."""
    from loongforge.devices.cpu_malloc import tune_glibc_malloc

    tune_glibc_malloc()  # as every LoongForge CPU run does (LOONGFORGE_CPU_MALLOC=system: glibc's defaults)
    import torch
    from loongforge.models.sparse_attention import (
        index_scores_reference,
        indexer_kl_loss,
        indexer_kl_loss_reference,
        select_topk,
        select_topk_reference,
        sparse_attention,
        sparse_attention_reference,
    )

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    seq, scale = args.seq, args.dk ** -0.5

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    q, k, v = leaf(1, seq, args.heads, args.dk), leaf(1, seq, 1, args.dk), leaf(1, seq, 1, args.dv)
    # indexer queries/keys shifted so that few dot products are negative and weights positive: a score is then
    # almost never exactly 0 (every head's ReLU zero), so no two keys tie for the last top-k place and both sides
    # select the same keys (with ties, each would make a valid but different choice)
    iq = (torch.randn(1, seq, args.index_heads, args.index_dim, generator=gen) + 0.5).requires_grad_()
    ik = (torch.randn(1, seq, args.index_dim, generator=gen) + 0.5).requires_grad_()
    iw = (torch.rand(1, seq, args.index_heads, generator=gen) * args.index_dim ** -0.5).requires_grad_()
    weight = torch.randn(1, seq, args.heads, args.dv, generator=gen)
    inputs = (q, k, v, iq, ik, iw)

    def step() -> tuple[float, float, float]:
        for tensor in inputs:
            tensor.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        if args.worker == "efficient":
            indices = select_topk(iq, ik, iw, args.topk)
            out, head_sum = sparse_attention(q, k, v, indices, scale, return_head_sum=True)
            kl = indexer_kl_loss(iq, ik, iw, q, k, scale, indices, attention_head_sum=head_sum)
        else:
            scores = index_scores_reference(iq, ik, iw)
            indices = select_topk_reference(scores.detach(), args.topk)
            out = sparse_attention_reference(q, k, v, indices, scale)
            kl = indexer_kl_loss_reference(scores, q, k, scale, indices)
        loss = (out * weight).sum() + kl
        loss.backward()
        return time.perf_counter() - start, time.process_time() - cpu_start, loss.item()

    baseline = _rss_mib()
    for _ in range(args.warmup):
        step()
    times, cpu_times, losses = zip(*(step() for _ in range(args.repeats)), strict=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"side": args.worker, "seq": seq, "median_s": statistics.median(times), "times_s": list(times),
            "median_cpu_s": statistics.median(cpu_times),
            "loss": losses[-1], "baseline_rss_mib": baseline, "peak_rss_mib": peak, "step_peak_mib": peak - baseline}


def run_child(argv: list[str], side: str, seq: int) -> dict:
    command = [sys.executable, __file__, *argv, "--worker", side, "--seq", str(seq)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"{side} at seq {seq} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    parser.add_argument("--dk", type=int, default=64, help="query/key head width: latent + rope (default 64)")
    parser.add_argument("--dv", type=int, default=48, help="value width: the latent (default 48)")
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--index-dim", type=int, default=32)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=12.0,
                        help="skip a reference run whose extrapolated peak exceeds this (default 12)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    passed = [a for i, a in enumerate(raw) if a != "--out" and (i == 0 or raw[i - 1] != "--out")]
    print(f"config: 1 x seq, {args.heads} query heads over 1 shared latent head (dk {args.dk}, dv {args.dv}), "
          f"indexer {args.index_heads} x {args.index_dim}, top-k {args.topk}, {args.threads} threads, "
          f"median of {args.repeats} after {args.warmup} warm-up; fwd+bwd of top-k + attention + sparse KL")
    print(f"host load average at start: {_load()}")
    results: dict[int, dict[str, dict]] = {}
    last_reference: dict | None = None
    for seq in sorted(args.seqs):
        results[seq] = {"efficient": run_child(raw, "efficient", seq)}
        predicted = None
        if last_reference is not None:
            predicted = last_reference["step_peak_mib"] * (seq / last_reference["seq"]) ** 2 / 1024
        if predicted is not None and predicted > args.max_gib:
            reason = (f"predicted step peak {predicted:.1f} GiB (the {last_reference['seq']} run's x (seq ratio)^2) "
                      f"> --max-gib {args.max_gib:g}")
            results[seq]["reference"] = {"skipped": reason}
        else:
            last_reference = results[seq]["reference"] = run_child(raw, "reference", seq)
        for side in SIDES:
            r = results[seq][side]
            if "skipped" in r:
                print(f"seq {seq:6d} {side:9s} skipped: {r['skipped']}", flush=True)
            else:
                print(f"seq {seq:6d} {side:9s} {r['median_s']:8.3f} s (cpu {r['median_cpu_s']:.3f} s)  "
                      f"step peak {r['step_peak_mib']:8.0f} MiB (peak RSS {r['peak_rss_mib']:.0f} MiB)  "
                      f"loss {r['loss']:.6g}", flush=True)
    print(f"host load average at end: {_load()}")
    print(f"\n{'seq':>6} {'efficient s':>12} {'reference s':>12} {'time ratio':>11} {'cpu-s ratio':>12} "
          f"{'eff. MiB':>9} {'ref. MiB':>9} {'memory ratio':>13}")
    for seq, sides in results.items():
        eff, ref = sides["efficient"], sides["reference"]
        if "skipped" in ref:
            print(f"{seq:6d} {eff['median_s']:12.3f} {'skipped':>12} {'-':>11} {'-':>12} {eff['step_peak_mib']:9.0f} "
                  f"{'skipped':>9} {'-':>13}")
            continue
        print(f"{seq:6d} {eff['median_s']:12.3f} {ref['median_s']:12.3f} {ref['median_s'] / eff['median_s']:10.2f}x "
              f"{ref['median_cpu_s'] / eff['median_cpu_s']:11.2f}x {eff['step_peak_mib']:9.0f} "
              f"{ref['step_peak_mib']:9.0f} {ref['step_peak_mib'] / max(eff['step_peak_mib'], 1.0):12.2f}x")
    figures = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "seq", "out")},
               "results": results, "argv": passed}
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2, default=str))
    return figures


if __name__ == "__main__":
    main()
