"""LoongForge against its peers on one tiny Llama: the same shapes, data, optimizer and steps, side by side.

Sides (``--sides``, all by default):

* ``loongforge`` / ``loongforge-compiled`` -- the public train API (``training.compile: true`` for the second, the
  counterpart of ``plain-compiled``'s whole-model ``torch.compile``; ``--compile-mode regional`` compiles each layer);
* ``plain`` / ``plain-compiled`` -- a hand-written PyTorch loop (:mod:`plain_llama`), eager and ``torch.compile``;
* ``hf`` -- Hugging Face ``LlamaForCausalLM`` (SDPA attention) in the same plain loop;
* ``hf-trainer`` -- the same model through ``transformers.Trainer`` (``pip install './loongforge-core[bench]'``
  installs transformers and accelerate beside the torch already there; ``--hf-python`` runs the two Hugging Face
  sides with another interpreter instead).

Why fresh processes taking turns: each side runs in its own worker process (so peak RSS and time to first step
are its own), and the workers of one round take turns step by step (:mod:`lockstep`: side A's step k, side B's step
k, ...; the others wait, blocked, using no CPU), so every step of every side is timed within a second of the other
sides' same step and the host's drift (10-20% within minutes on shared cores) hits all sides alike. Start-up is one
side at a time. Figures are medians over ``--rounds`` rounds (fresh processes each, the order flipped every round)
with the spread (min-max) beside them; each ratio to LoongForge eager is also given as the median of the step-by-step
ratios (``paired``: LoongForge's step time over the side's, at the same step of the same round), the figure the
drift does not move. Throughput is ``batch x seq`` over the median step time after ``--warmup`` steps. The
non-LoongForge sides read the very batches LoongForge's pipeline produces (the shipped corpus, byte tokenizer),
saved once by the parent, and import nothing from LoongForge.

MFU: training FLOPs per token from the layout planner's model (:func:`loongforge.planner.timing.flops_per_token`: 6
x parameters in the matmuls plus attention), against a peak measured here by the CPU backend's fp32 GEMM probe
(:func:`loongforge.devices.matmul_peak.measured_matmul_peak`, the peak a CPU run's ``mfu`` metric uses) at the same
thread count, the best of every round's probe. ``--nproc 2`` adds LoongForge at tp=2 and dp=2 on two processes
(torchrun, gloo, one thread each): tokens/s per layout and the scaling efficiency (layout tokens/s over the
one-process eager figure on the same cores). Usage::

    python benchmarks/llm_pretrain.py                                 # the issue's settings, 6 rounds
    python benchmarks/llm_pretrain.py --rounds 3 --sides loongforge,plain --json out.json
    python benchmarks/llm_pretrain.py --nproc 2                       # also tp=2 and dp=2 on two processes

Every side: fp32, AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1 on matrices), gradient clipping at 1.0, untied output
layer, causal SDPA, ``--layers``/``--hidden``/... the shape (defaults: the issue's 4 layers, d256, 4 heads MHA,
ffn 688, vocab 384, seq 256, micro-batch 8).

Kernels: the peers run torch's own (``mm`` through MKL, the unfused SwiGLU and norm backward of autograd). LoongForge
runs what its CPU backend picks: on x86 processors other than Intel's its linear layers use oneDNN's GEMM
(:mod:`loongforge.devices.megatron_cpu.gemm`), plus its SwiGLU, RMSNorm and RoPE kernels; run with
``LOONGFORGE_CPU_GEMM=aten`` to compare on torch's GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep import Baton, paired_ratio, run_in_lockstep

HERE = Path(__file__).resolve().parent
HF_SIDES = ("hf", "hf-trainer")
SIDES = ("loongforge", "loongforge-compiled", "plain", "plain-compiled", *HF_SIDES)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _process_age() -> float:
    """Seconds since this process started (Linux ``/proc``), so first-step times include the imports."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start


# -- workers (each runs in a fresh process and prints one JSON line) ------------------------------------------


def _loongforge_overrides(args: argparse.Namespace, out: str) -> list[str]:
    return [
        f"model.name={args.model}", f"model.overrides.num_layers={args.layers}",
        f"model.overrides.hidden_size={args.hidden}", f"model.overrides.num_attention_heads={args.heads}",
        f"model.overrides.num_query_groups={args.groups}", f"model.overrides.ffn_hidden_size={args.ffn}",
        f"run.output_dir={out}", "run.seed=1", "data.dataset=shipped-corpus", f"data.seq_length={args.seq}",
        f"training.steps={args.steps}", f"training.micro_batch_size={args.batch}", "training.precision=fp32",
        "optimizer.lr=3e-4", "optimizer.weight_decay=0.1", "optimizer.beta2=0.95", "optimizer.grad_clip=1.0",
        "scheduler.warmup_steps=0", "scheduler.decay=constant", "logging.progress=false",
        "logging.tensorboard=false", "logging.interval=1", "checkpoint.save_at_end=false",
    ]


def worker_loongforge(args: argparse.Namespace, baton: Baton, compiled: bool = False) -> dict:
    from loongforge import hookimpl
    from loongforge.config import load_config
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    step_times: list[float] = []
    first_step_at: list[float] = []

    class Timer:
        @hookimpl
        def loongforge_on_train_start(self, trainer):
            baton.take()

        @hookimpl
        def loongforge_on_step_end(self, step, metrics):
            step_times.append(metrics["step_time"])
            if not first_step_at:
                first_step_at.append(_process_age())
            baton.give_back()
            if step < args.steps:
                baton.take()

    get_host().register(Timer(), "benchmark-timer")
    with tempfile.TemporaryDirectory() as out:
        overrides = _loongforge_overrides(args, out) + [f"training.threads={args.threads}"]
        if compiled:
            overrides.append(f"training.compile={args.compile_mode}")
        summary = run_training(load_config(None, overrides))
    return {"step_times": step_times, "first_step_s": first_step_at[0], "compile_s": summary.get("compile_s"),
            "memory_mib": summary.get("memory_mib")}


def _saved_batches(args: argparse.Namespace) -> list[dict]:
    import torch

    return torch.load(args.batches)


def _decay_groups(model) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _plain_loop(args: argparse.Namespace, baton: Baton, model, loss_of) -> dict:
    import torch

    optimizer = torch.optim.AdamW(_decay_groups(model), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    step_times, first_step_s = [], None
    for batch in _saved_batches(args)[: args.steps]:
        baton.take()
        start = time.perf_counter()
        loss = loss_of(model, batch["tokens"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        step_times.append(time.perf_counter() - start)
        if first_step_s is None:
            first_step_s = _process_age()
        baton.give_back()
    return {"step_times": step_times, "first_step_s": first_step_s}


def worker_plain(args: argparse.Namespace, baton: Baton, compiled: bool = False) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from plain_llama import PlainLlama

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    model = PlainLlama(vocab=args.vocab, dim=args.hidden, layers=args.layers, heads=args.heads, groups=args.groups,
                       ffn=args.ffn, seq=args.seq, theta=args.rope_theta, eps=args.norm_eps)
    forward = torch.compile(model) if compiled else model
    return _plain_loop(args, baton, model, lambda _, tokens, labels: forward(tokens, labels))


def _hf_model(args: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.groups, max_position_embeddings=args.seq,
                         rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _hf_loss(model, tokens, labels):
    import torch.nn.functional as F

    logits = model(input_ids=tokens).logits  # labels are already shifted: the plain cross-entropy of the logits
    return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def worker_hf(args: argparse.Namespace, baton: Baton) -> dict:
    return _plain_loop(args, baton, _hf_model(args), _hf_loss)


def worker_hf_trainer(args: argparse.Namespace, baton: Baton) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    batches = _saved_batches(args)[: args.steps]
    step_times, first_step_at, started = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            baton.take()
            started.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - started[-1])
            if not first_step_at:
                first_step_at.append(_process_age())
            baton.give_back()

    class Batches(torch.utils.data.Dataset):  # one saved batch per step, in order
        def __len__(self):
            return len(batches) * args.batch

        def __getitem__(self, index):
            batch = batches[index // args.batch]
            return {"tokens": batch["tokens"][index % args.batch], "labels": batch["labels"][index % args.batch]}

    class CausalLMTrainer(Trainer):
        def _get_train_sampler(self, *_, **__):  # the saved batches in their order
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return _hf_loss(model, inputs["tokens"], inputs["labels"])

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=3e-4,
            adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.1, max_grad_norm=1.0,
            lr_scheduler_type="constant", warmup_steps=0, logging_strategy="no", save_strategy="no",
            report_to=[], use_cpu=True, dataloader_num_workers=0, seed=1, disable_tqdm=True,
            remove_unused_columns=False, optim="adamw_torch",
        )
        CausalLMTrainer(model=_hf_model(args), args=training_args, train_dataset=Batches(),
                        data_collator=lambda rows: {key: torch.stack([r[key] for r in rows]) for key in rows[0]},
                        callbacks=[Timer()]).train()
    return {"step_times": step_times, "first_step_s": first_step_at[0]}


WORKERS = {
    "loongforge": worker_loongforge,
    "loongforge-compiled": lambda args, baton: worker_loongforge(args, baton, compiled=True),
    "plain": worker_plain,
    "plain-compiled": lambda args, baton: worker_plain(args, baton, compiled=True),
    "hf": worker_hf,
    "hf-trainer": worker_hf_trainer,
}

#: The shape and settings every worker gets on its command line.
_SHARED = ("model", "steps", "batch", "seq", "threads", "layers", "hidden", "heads", "groups", "ffn", "vocab",
           "rope_theta", "norm_eps", "batches", "compile_mode")


def worker_command(side: str, args: argparse.Namespace) -> list[str]:
    python = args.hf_python if side in HF_SIDES and args.hf_python else sys.executable
    command = [python, __file__, "--worker", side]
    for name in _SHARED:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return command


def run_round(sides: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """One worker per side, taking turns step by step (:func:`lockstep.run_in_lockstep`); their results."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(args.threads)}
    return run_in_lockstep({side: worker_command(side, args) for side in sides}, args.steps, env)


def run_layout(layout: str, args: argparse.Namespace) -> dict:
    """LoongForge on two processes (``tp`` or ``dp``), one thread each, through torchrun; step times from the
    run's metrics file."""
    with tempfile.TemporaryDirectory() as out:
        config = Path(out) / "run.yaml"
        config.write_text("run: {seed: 1}\n")  # everything else is an override, as for the one-process sides
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "loongforge.cli", "train", str(config), *_loongforge_overrides(args, out),
                   "training.threads=1", *(["parallel.tp=2"] if layout == "tp" else [])]  # else dp = world size
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{layout}=2 run failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    dp = 2 if layout == "dp" else 1
    return {"step_times": [row["step_time"] for row in rows], "tokens_per_step": dp * args.batch * args.seq}


# -- the parent ----------------------------------------------------------------------------------------------


def _shape(args: argparse.Namespace) -> None:
    """Fill the vocabulary (padded as LoongForge pads it), RoPE base and norm epsilon from the model flavor."""
    from loongforge.models.decoder_model import padded_vocab_size
    from loongforge.plugins import get_registry

    flavor = get_registry("model").load(args.model)
    args.vocab = padded_vocab_size(flavor.vocab_size)
    args.rope_theta, args.norm_eps = flavor.rope_theta, flavor.norm_eps
    args.flavor = flavor.with_overrides(num_layers=args.layers, hidden_size=args.hidden,
                                        num_attention_heads=args.heads, num_query_groups=args.groups,
                                        ffn_hidden_size=args.ffn)


def _save_batches(args: argparse.Namespace, path: Path) -> None:
    """The batches LoongForge trains on (shipped corpus, seed 1), for the other sides to read."""
    import torch
    from loongforge.data.gpt_dataset import GPTSampleDataset
    from loongforge.data.sampler import TrainBatchIterator
    from loongforge.data.shipped import shipped_corpus_dataset

    batches = TrainBatchIterator(GPTSampleDataset(shipped_corpus_dataset(), args.seq), args.batch, seed=1)
    torch.save([{key: next_batch[key] for key in ("tokens", "labels")}
                for next_batch in (next(batches) for _ in range(args.steps))], path)


def _paired(numerator: list[dict], denominator: list[dict], args: argparse.Namespace) -> float:
    """Median over the timed steps of every round of ``numerator``'s step time over ``denominator``'s at the same
    step (the two sides took turns step by step, so each pair saw the same machine)."""
    pairs = [(a["step_times"][step], b["step_times"][step]) for a, b in zip(numerator, denominator, strict=True)
             for step in range(args.warmup, args.steps)]
    return paired_ratio(*zip(*pairs, strict=True))


def _median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads (4: multi-head attention)")
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    parser.add_argument("--compile-mode", default="true", choices=("regional", "true"),
                        help="training.compile of the loongforge-compiled side (true: layers and the modules "
                             "around them, as plain-compiled compiles its whole model)")
    parser.add_argument("--hf-python", default=None, help="interpreter for the Hugging Face sides")
    parser.add_argument("--nproc", type=int, default=1, choices=(1, 2), help="2: also tp=2 and dp=2 layouts")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for hidden in ("vocab", "rope-theta", "norm-eps", "batches"):
        parser.add_argument(f"--{hidden}", type=float if hidden in ("rope-theta", "norm-eps") else str,
                            help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        if args.vocab is not None:
            args.vocab = int(args.vocab)
        baton = Baton.from_environment()
        result = WORKERS[args.worker](args, baton)
        result["peak_rss_mib"] = _peak_rss_mib()
        baton.wait_to_finish()
        print(json.dumps(result))
        return

    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the warm-up steps are left out")
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    _shape(args)
    from loongforge.devices.matmul_peak import measured_matmul_peak
    from loongforge.planner.memory import Workload
    from loongforge.planner.timing import flops_per_token

    flops = flops_per_token(Workload(args.flavor, args.seq, "fp32", kernels="local"))[0]
    peak = measured_matmul_peak(threads=args.threads)  # again every round: the best rate is the least disturbed one
    tokens_per_step = args.batch * args.seq
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        args.batches = str(Path(scratch) / "batches.pt")
        _save_batches(args, Path(args.batches))
        for round_index in range(args.rounds):
            peak = max(peak, measured_matmul_peak(threads=args.threads))
            results = run_round(sides if round_index % 2 == 0 else sides[::-1], args)
            for side in sides:
                result = results[side]
                result["tokens_per_s"] = tokens_per_step / statistics.median(result["step_times"][args.warmup:])
                samples[side].append(result)
                print(f"round {round_index + 1} {side:20s} {result['tokens_per_s']:9,.0f} tokens/s", flush=True)
            if args.nproc == 2:
                for layout in ("tp", "dp"):
                    result = run_layout(layout, args)
                    result["tokens_per_s"] = (result["tokens_per_step"]
                                              / statistics.median(result["step_times"][args.warmup:]))
                    samples.setdefault(f"loongforge {layout}=2", []).append(result)
                    print(f"round {round_index + 1} loongforge {layout}=2      {result['tokens_per_s']:9,.0f} "
                          f"tokens/s", flush=True)

    print(f"\n{args.model} ({args.layers} layers, d{args.hidden}, {args.heads} heads / {args.groups} kv, ffn "
          f"{args.ffn}, vocab {args.vocab}): batch {args.batch} x seq {args.seq}, {args.steps} steps "
          f"({args.warmup} warm-up), {args.threads} threads, fp32, {args.rounds} alternating rounds")
    print(f"FLOPs/token {flops / 1e6:.1f} M (planner), fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s (probe)\n")
    reference = statistics.median(r["tokens_per_s"] for r in samples.get("loongforge", [])) if "loongforge" in \
        samples else None
    header = f"{'side':22s}{'tokens/s':>10s}{'(min-max)':>16s}{'vs LF':>7s}{'paired':>7s}{'MFU':>7s}" \
             f"{'peak RSS MiB':>18s}{'first step s':>14s}"
    print(header)
    table = {}
    for side, results in samples.items():
        tps, low, high = _median_spread([r["tokens_per_s"] for r in results])
        row = {"tokens_per_s": tps, "tokens_per_s_min": low, "tokens_per_s_max": high, "mfu": tps * flops / peak,
               "rounds": len(results)}
        line = f"{side:22s}{tps:10,.0f}{f'({low:,.0f}-{high:,.0f})':>16s}"
        line += f"{tps / reference:7.2f}" if reference else f"{'':7s}"
        if reference and "tokens_per_step" not in results[0]:  # step by step, at the same step of the same round
            row["vs_loongforge_paired"] = _paired(samples["loongforge"], results, args)
            line += f"{row['vs_loongforge_paired']:7.2f}"
        else:
            line += f"{'':7s}"
        line += f"{row['mfu']:7.1%}"
        if "peak_rss_mib" in results[0]:
            rss = _median_spread([r["peak_rss_mib"] for r in results])
            first = statistics.median(r["first_step_s"] for r in results)
            row.update(peak_rss_mib=rss[0], peak_rss_mib_range=rss[1:], first_step_s=first)
            line += f"{rss[0]:8,.0f} ({rss[1]:,.0f}-{rss[2]:,.0f}){first:14.1f}"
        if results[0].get("compile_s") is not None:
            row["compile_s"] = statistics.median(r["compile_s"] for r in results)
            line += f"   compile {row['compile_s']:.1f} s"
        if "tokens_per_step" in results[0] and "loongforge" in table:
            row["scaling_efficiency"] = tps / table["loongforge"]["tokens_per_s"]
            line += f"   scaling {row['scaling_efficiency']:.2f}"
        table[side] = row
        print(line)
    print("\n'vs LF' is the side's tokens/s over LoongForge eager's (below 1.00: LoongForge is faster); 'paired' is "
          "the median of LoongForge's step time over the side's at the same step of the same round (the sides take "
          "turns step by step), which the machine's drift does not move.")
    compiled = {}
    if {"loongforge-compiled", "plain-compiled"} <= samples.keys():
        compiled = {"speedup": table["loongforge-compiled"]["tokens_per_s"] / table["plain-compiled"]["tokens_per_s"],
                    "paired_speedup": _paired(samples["plain-compiled"], samples["loongforge-compiled"], args)}
        print(f"loongforge-compiled over plain-compiled: {compiled['speedup']:.2f}x tokens/s, "
              f"paired {compiled['paired_speedup']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": {name: getattr(args, name) for name in _SHARED if name != "batches"} | {
                "warmup": args.warmup, "rounds": args.rounds, "hf_python": args.hf_python},
            "flops_per_token": flops, "gemm_peak_flops": peak, "sides": table, "compiled": compiled,
        }, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
