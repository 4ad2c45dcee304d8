"""LoongForge vs a plain PyTorch loop: the same tiny Llama, the same steps, one run, side by side.

Each side runs in a fresh worker process (so peak RSS and time to first step are its own), and the sides
alternate for ``--rounds`` rounds so that machine noise hits both alike. Throughput is the median step
time after ``--warmup`` steps. Usage::

    python benchmarks/llm_pretrain.py                     # llama-tiny: 4 layers, d256, seq 256, batch 8
    python benchmarks/llm_pretrain.py --steps 40 --rounds 3 --threads 2

Both sides: fp32, AdamW (lr 3e-4, wd 0.1), grad clipping at 1.0, the same shapes, causal SDPA with GQA,
the shipped corpus tokenized by the byte tokenizer.
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

HERE = Path(__file__).resolve().parent


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _process_age() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def worker_loongforge(args: argparse.Namespace) -> dict:
    import tempfile

    from loongforge import hookimpl
    from loongforge.config import load_config
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    step_times: list[float] = []
    first_step_at: list[float] = []

    class Timer:
        @hookimpl
        def loongforge_on_step_end(self, step, metrics):
            step_times.append(metrics["step_time"])
            if not first_step_at:
                first_step_at.append(_process_age())

    get_host().register(Timer(), "benchmark-timer")
    with tempfile.TemporaryDirectory() as out:
        config = load_config(None, [
            f"model.name={args.model}", f"run.output_dir={out}", "run.seed=1",
            "data.dataset=shipped-corpus", f"data.seq_length={args.seq}",
            f"training.steps={args.steps}", f"training.micro_batch_size={args.batch}",
            f"training.threads={args.threads}", "training.precision=fp32",
            "optimizer.lr=3e-4", "optimizer.weight_decay=0.1", "optimizer.grad_clip=1.0",
            "scheduler.warmup_steps=0", "scheduler.decay=constant",
            "logging.progress=false", "logging.tensorboard=false", f"logging.interval={args.steps}",
            "checkpoint.save_at_end=false",
        ])
        run_training(config)
    return {"step_times": step_times, "first_step_s": first_step_at[0]}


def worker_plain(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from loongforge.data.gpt_dataset import GPTSampleDataset
    from loongforge.data.sampler import TrainBatchIterator
    from loongforge.data.shipped import shipped_corpus_dataset
    from loongforge.models.builder import padded_vocab_size
    from loongforge.plugins import get_registry
    from plain_llama import PlainLlama, train_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    flavor = get_registry("model").load(args.model)
    model = PlainLlama(
        vocab=padded_vocab_size(flavor.vocab_size), dim=flavor.hidden_size, layers=flavor.num_layers,
        heads=flavor.num_attention_heads, groups=flavor.num_query_groups, ffn=flavor.ffn_hidden_size,
        seq=args.seq, theta=flavor.rope_theta, eps=flavor.norm_eps,
    )
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )
    batches = TrainBatchIterator(GPTSampleDataset(shipped_corpus_dataset(), args.seq), args.batch, seed=1)
    step_times, first_step_s = [], None
    for _ in range(args.steps):
        batch = next(batches)
        start = time.perf_counter()
        train_step(model, optimizer, batch["tokens"], batch["labels"], grad_clip=1.0)
        step_times.append(time.perf_counter() - start)
        if first_step_s is None:
            first_step_s = _process_age()
    return {"step_times": step_times, "first_step_s": first_step_s}


WORKERS = {"loongforge": worker_loongforge, "plain-pytorch": worker_plain}


def run_worker(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", side, "--model", args.model, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{side} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = WORKERS[args.worker](args)
        result["peak_rss_mib"] = _peak_rss_mib()
        print(json.dumps(result))
        return

    tokens_per_step = args.batch * args.seq
    samples: dict[str, list[dict]] = {side: [] for side in WORKERS}
    for round_index in range(args.rounds):
        for side in (WORKERS if round_index % 2 == 0 else reversed(list(WORKERS))):
            result = run_worker(side, args)
            timed = result["step_times"][args.warmup:]
            result["tokens_per_s"] = tokens_per_step / statistics.median(timed)
            samples[side].append(result)
            print(f"round {round_index + 1} {side:14s} {result['tokens_per_s']:9,.0f} tokens/s", flush=True)

    print(f"\n{args.model}: batch {args.batch} x seq {args.seq}, {args.steps} steps ({args.warmup} warm-up), "
          f"{args.threads} threads, fp32, {args.rounds} alternating rounds")
    print(f"{'':16s}{'tokens/s':>12s}{'peak RSS MiB':>14s}{'first step s':>14s}")
    summary = {}
    for side, results in samples.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        rss = statistics.median(r["peak_rss_mib"] for r in results)
        first = statistics.median(r["first_step_s"] for r in results)
        summary[side] = tps
        print(f"{side:16s}{tps:12,.0f}{rss:14,.0f}{first:14.1f}")
    print(f"\nratio loongforge / plain-pytorch tokens/s: {summary['loongforge'] / summary['plain-pytorch']:.3f}")


if __name__ == "__main__":
    main()
