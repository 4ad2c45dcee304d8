"""LoongForge's Wan DiT vs diffusers' ``WanTransformer3DModel``, eager and compiled: training-step time on one tiny
config.

Four sides hold the same weights (ours converted from diffusers' with ``from_diffusers``) and train on the same
inputs; a step is forward, an MSE loss against a fixed velocity target, backward and an AdamW update:

- ``loongforge``: ``WanModel`` eagerly, with the AdamW the task engine uses (PyTorch's fused kernel where it
  applies: :func:`loongforge.train.engines.task.fused_adamw_applies`);
- ``loongforge-compiled``: the same, compiled by :func:`loongforge.train.compile.compile_blocks` as
  ``training.compile: true`` does, the whole model (``--compile regional``: only its blocks);
- ``diffusers``: ``WanTransformer3DModel`` eagerly with ``torch.optim.AdamW``'s defaults, as diffusers' training
  examples build it;
- ``diffusers-compiled``: the same, compiled as diffusers recommends, ``compile_repeated_blocks()`` (its regional
  compile of the ``WanTransformerBlock`` stack; ``--diffusers-compile full``: ``torch.compile`` of the whole model).

Every side first runs ``--warmup`` steps (the compiled sides compile there; their first step is reported as the
compile cost). Then ``--rounds`` rounds, each running ``--steps`` steps of every side in turn, the order rotated
every round, so machine noise (other processes on shared cores) hits all sides alike. Reported: each side's
median step over all timed steps, the spread of its per-round medians, and speed-ups: the other side's median over
this side's, and the median over rounds of the same ratio within each round (``round_speedup``; the sturdier of
the two when the load changes between rounds, as it does on shared cores). ``--clock cpu`` times each step by the
CPU seconds this process spent in it (``time.process_time``: every thread's, so with ``--threads 2`` it counts
both cores) instead of wall-clock seconds: time spent waiting for a core another process holds is left out, which
makes figures taken on busy shared cores comparable. Usage::

    python benchmarks/diffusion_wan_step.py                           # d64, 2 layers, 4x16x16 video, batch 8
    python benchmarks/diffusion_wan_step.py --rounds 8 --steps 10 --out wan_step.json
    python benchmarks/diffusion_wan_step.py --dim 256 --heads 4 --layers 4 --side 32 --threads 2
    python benchmarks/diffusion_wan_step.py --threads 1 --clock cpu               # on cores other jobs share

Needs diffusers (``pip install loongforge-diffusion[test]``) and, for the compiled sides, a C++ compiler.
Targets (issue 21): loongforge-compiled >= 1.5x diffusers and >= 1.1x diffusers-compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from loongforge.train.compile import compile_blocks
from loongforge.train.engines.task import fused_adamw_applies
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, from_diffusers
from loongforge_diffusion.wan.flavors import FLAVORS
from loongforge_diffusion.wan.model import WanModel

SIDES = ("loongforge", "loongforge-compiled", "diffusers", "diffusers-compiled")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def training_step(model: torch.nn.Module, forward: Callable[[], torch.Tensor], target: torch.Tensor,
                  optimizer: torch.optim.Optimizer, clock: Callable[[], float]) -> Callable[[], float]:
    """One timed step of ``model``: ``forward()``, MSE against ``target``, backward, ``optimizer``; returns
    seconds by ``clock``."""

    def step() -> float:
        start = clock()
        loss = torch.nn.functional.mse_loss(forward(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return clock() - start

    return step


def build_sides(args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    flavor = FLAVORS["wan-tiny"].with_overrides(dim=args.dim, num_heads=args.heads, num_layers=args.layers,
                                                ffn_dim=2 * args.dim)
    torch.manual_seed(0)
    shape = (args.batch, flavor.in_channels, args.frames, args.side, args.side)
    video, target = torch.randn(shape), torch.randn(shape)
    context = torch.randn(args.batch, flavor.text_len, flavor.text_dim)
    timestep = torch.rand(args.batch) * 1000
    weights = WanTransformer3DModel(**diffusers_config(flavor)).state_dict()
    sides = {}
    for name in SIDES:
        if name.startswith("loongforge"):
            model = WanModel(flavor)
            model.load_state_dict(from_diffusers(weights))
            if name.endswith("compiled"):
                mode = True if args.compile == "true" else "regional"
                compile_blocks([] if mode is True else model.blocks, mode, rest=[model])
            params = list(model.parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw_applies(params))
            forward = (lambda m: lambda: m(video, timestep, context))(model)
        else:
            model = WanTransformer3DModel(**diffusers_config(flavor))
            model.load_state_dict(weights)
            if name.endswith("compiled"):
                if args.diffusers_compile == "full":
                    model.compile()
                else:
                    model.compile_repeated_blocks()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            forward = (lambda m: lambda: m(video, timestep, context, return_dict=False)[0])(model)
        sides[name] = training_step(model, forward, target, optimizer, CLOCKS[args.clock])
    return sides


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--side", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side (the compiled sides compile)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall-clock or this process's CPU seconds per step")
    parser.add_argument("--compile", choices=("regional", "true"), default="true",
                        help="training.compile of the loongforge-compiled side")
    parser.add_argument("--diffusers-compile", choices=("regional", "full"), default="regional")
    parser.add_argument("--sides", nargs="*", choices=SIDES, default=list(SIDES))
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sides = {name: step for name, step in build_sides(args).items() if name in args.sides}

    first: dict[str, float] = {}
    for name, step in sides.items():
        first[name] = step()
        for _ in range(args.warmup - 1):
            step()
    times: dict[str, list[float]] = {name: [] for name in sides}
    round_medians: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for index in range(args.rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            elapsed = [sides[name]() for _ in range(args.steps)]
            times[name] += elapsed
            round_medians[name].append(statistics.median(elapsed))
    medians = {name: statistics.median(values) for name, values in times.items()}
    speedups = {name: {other: medians[other] / medians[name] for other in medians if other != name}
                for name in medians}
    round_speedups = {name: {other: statistics.median(o / t for o, t in zip(round_medians[other], round_medians[name],
                                                                            strict=True))
                             for other in medians if other != name} for name in medians}
    tokens = args.batch * args.frames * (args.side // 2) ** 2
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tokens_per_step": tokens, "torch": torch.__version__,
        "sides": {name: {"median_step_ms": medians[name] * 1e3, "tokens_per_s": tokens / medians[name],
                         "round_median_ms": [t * 1e3 for t in round_medians[name]], "first_step_s": first[name]}
                  for name in sides},
        "speedup": speedups, "round_speedup": round_speedups,
    }
    print(f"config: d{args.dim} {args.heads} heads {args.layers} layers, batch {args.batch}, {tokens} tokens/step, "
          f"{args.threads} threads, {args.rounds} rounds x {args.steps} timed steps per side, {args.clock} clock")
    print(f"{'side':>20} {'median ms':>10} {'round medians ms (min-max)':>28} {'first step s':>13}")
    for name in sides:
        spread = round_medians[name]
        print(f"{name:>20} {medians[name] * 1e3:10.2f} {min(spread) * 1e3:13.2f} - {max(spread) * 1e3:<12.2f} "
              f"{first[name]:13.2f}")
    for name in (n for n in ("loongforge", "loongforge-compiled") if n in sides):
        against = ", ".join(f"{speedups[name][other]:.2f}x vs {other} (per round {round_speedups[name][other]:.2f}x)"
                            for other in sides if other.startswith("diffusers"))
        print(f"{name}: {against}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
