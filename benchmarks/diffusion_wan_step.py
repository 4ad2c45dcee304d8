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

Each side runs as its user would run it, in a fresh process of its own: the LoongForge sides first set the process
up as every LoongForge run does (the selected device backend's ``configure_env``; on CPU that tunes glibc malloc,
see :mod:`loongforge.devices.cpu_malloc`; ``LOONGFORGE_CPU_MALLOC=system`` leaves glibc's defaults for a comparison
without it), the diffusers sides run in a plain process. A process runs ``--warmup`` untimed steps (the compiled
sides compile there; their first step is reported as the compile cost), then ``--steps`` timed steps.

Why the processes take turns: on a shared 2-core host the speed of the same code drifts by 10-20% within minutes,
more than the differences measured here. All sides of a round are alive at once and run in turn, ``--turn-steps``
steps at a time (:mod:`lockstep`; a turn of a few ~30 ms steps keeps each side's caches warm), so every turn of a
side is measured within a second of the other sides' turns. ``--rounds`` rounds start fresh processes, the order
rotated every round. Reported: each side's median step over all timed steps, the spread of its per-round medians,
its peak RSS, and speed-ups: the other side's median over this side's, and the median over every turn of the same
ratio taken turn by turn (``paired_speedup``: the machine was the same for both, so drift does not move it).
``--clock cpu`` times each step by the CPU seconds the process spent in it (``time.process_time``: every thread's,
so with ``--threads 2`` it counts both cores) instead of wall-clock seconds. Usage::

    python benchmarks/diffusion_wan_step.py                           # d64, 2 layers, 4x16x16 video, batch 8
    python benchmarks/diffusion_wan_step.py --rounds 8 --steps 20 --turn-steps 4 --out wan_step.json
    python benchmarks/diffusion_wan_step.py --dim 256 --heads 4 --layers 4 --side 32 --threads 2
    python benchmarks/diffusion_wan_step.py --threads 1 --clock cpu               # on cores other jobs share
    LOONGFORGE_CPU_MALLOC=system python benchmarks/diffusion_wan_step.py          # glibc's defaults on every side

``--experts`` times Wan 2.2 A14B's step instead: every side holds two models of the config, a high-noise and a
low-noise expert split at sigma 0.875, and the steps alternate between a batch of high and a batch of low noise
levels. LoongForge trains :class:`~loongforge_diffusion.wan.experts.WanExperts` (its forward picks the expert; the
idle one's gradients stay empty), diffusers two ``WanTransformer3DModel`` s picked as ``WanPipeline`` picks them
(``t >= boundary_ratio * 1000``: ``transformer``, else ``transformer_2``), each compiled as above::

    python benchmarks/diffusion_wan_step.py --experts --out wan_experts_step.json

Needs diffusers (``pip install loongforge-diffusion[test]``) and, for the compiled sides, a C++ compiler.
Targets (issue 21): loongforge-compiled >= 1.5x diffusers and >= 1.1x diffusers-compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lockstep import Baton, paired_ratio, run_in_lockstep
from loongforge_diffusion.wan.flavors import FLAVORS, WanFlavor

SIDES = ("loongforge", "loongforge-compiled", "diffusers", "diffusers-compiled")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
#: ``--experts``: Wan 2.2 T2V-A14B's boundary between the high- and the low-noise expert.
EXPERT_BOUNDARY = 0.875


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


def tiny_flavor(args: argparse.Namespace) -> WanFlavor:
    return FLAVORS["wan-tiny"].with_overrides(dim=args.dim, num_heads=args.heads, num_layers=args.layers,
                                              ffn_dim=2 * args.dim)


def step_timesteps(args: argparse.Namespace, timestep: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Each step's timesteps: ``timestep`` every step, or with ``--experts`` a batch above the boundary and one
    below it in turn (the same levels, squeezed into each expert's range)."""
    if not args.experts:
        return lambda: timestep
    edge = EXPERT_BOUNDARY * 1000
    batches = [edge + timestep / 1000 * (1000 - edge), timestep / 1000 * edge]
    taken = [0]

    def next_batch() -> torch.Tensor:
        taken[0] += 1
        return batches[taken[0] % 2]

    return next_batch


def inputs(args: argparse.Namespace, flavor: WanFlavor) -> tuple[torch.Tensor, ...]:
    """The batch every side trains on: video latents, velocity target, text context, timesteps (seeded)."""
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, flavor.in_channels, args.frames, args.side, args.side)
    return (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator),
            torch.randn(args.batch, flavor.text_len, flavor.text_dim, generator=generator),
            torch.rand(args.batch, generator=generator) * 1000)


def write_weights(args: argparse.Namespace, path: Path) -> None:
    """diffusers' initial weights for the config, saved once for every side's process to load."""
    from diffusers import WanTransformer3DModel
    from loongforge_diffusion.wan.diffusers_adapter import diffusers_config
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(WanTransformer3DModel(**diffusers_config(tiny_flavor(args))).state_dict(), path)


def loongforge_side(args: argparse.Namespace, weights: dict[str, torch.Tensor], flavor: WanFlavor,
                    video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                    ) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """``WanModel`` in a process set up as a LoongForge run sets it up (the device backend's ``configure_env``)."""
    from loongforge.devices.selection import select_backend
    from loongforge.plugins import get_host
    from loongforge.train.compile import compile_blocks
    from loongforge.train.engines.task import fused_adamw_applies
    from loongforge_diffusion.wan.diffusers_adapter import from_diffusers
    from loongforge_diffusion.wan.experts import WanExperts
    from loongforge_diffusion.wan.model import WanModel

    backend, _ = select_backend("auto", get_host().registry("device"))
    backend.configure_env()
    if args.experts:
        model = WanExperts(flavor.with_overrides(expert_boundary=EXPERT_BOUNDARY))
        dits = [model.high, model.low]
    else:
        model = WanModel(flavor)
        dits = [model]
    for dit in dits:
        dit.load_state_dict(from_diffusers(weights))
    if args.worker.endswith("compiled"):
        mode = True if args.compile == "true" else "regional"
        compile_blocks([] if mode is True else [b for dit in dits for b in dit.blocks], mode, rest=dits)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw_applies(params))
    timesteps = step_timesteps(args, timestep)
    return model, lambda: model(video, timesteps(), context), optimizer


def diffusers_side(args: argparse.Namespace, weights: dict[str, torch.Tensor], flavor: WanFlavor,
                   video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                   ) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """``WanTransformer3DModel`` in a plain process, compiled the way diffusers documents."""
    from diffusers import WanTransformer3DModel
    from loongforge_diffusion.wan.diffusers_adapter import diffusers_config

    models = [WanTransformer3DModel(**diffusers_config(flavor)) for _ in range(2 if args.experts else 1)]
    for model in models:
        model.load_state_dict(weights)
        if args.worker.endswith("compiled"):
            if args.diffusers_compile == "full":
                model.compile()
            else:
                model.compile_repeated_blocks()
    optimizer = torch.optim.AdamW([p for model in models for p in model.parameters()], lr=1e-4)
    timesteps = step_timesteps(args, timestep)

    def forward() -> torch.Tensor:
        t = timesteps()
        # WanPipeline's choice: transformer (high noise) from the boundary timestep on, transformer_2 below
        model = models[0] if len(models) == 1 or bool((t >= EXPERT_BOUNDARY * 1000).all()) else models[1]
        return model(video, t, context, return_dict=False)[0]

    return models[0], forward, optimizer


def worker(args: argparse.Namespace, baton: Baton) -> dict:
    """One side in this process. Its first turn builds the model and runs ``--warmup`` untimed steps (the first
    one timed as the compile cost); each later turn runs ``--turn-steps`` timed steps."""
    from safetensors.torch import load_file

    baton.take()
    torch.set_num_threads(args.threads)
    flavor = tiny_flavor(args)
    video, target, context, timestep = inputs(args, flavor)
    build = loongforge_side if args.worker.startswith("loongforge") else diffusers_side
    model, forward, optimizer = build(args, load_file(args.weights), flavor, video, timestep, context)
    step = training_step(model, forward, target, optimizer, CLOCKS[args.clock])
    first = step()
    for _ in range(args.warmup - 1):
        step()
    baton.give_back()
    turns = []
    for _ in range(args.steps // args.turn_steps):
        baton.take()
        turns.append([step() for _ in range(args.turn_steps)])
        baton.give_back()
    return {"turns_s": turns, "first_step_s": first,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_round(names: list[str], argv: list[str], weights: Path, turns: int) -> dict[str, dict]:
    """One worker per side (:func:`worker` in a fresh interpreter given the parent's ``argv``: a worker reads only
    the config options of it), taking turns; their results."""
    commands = {name: [sys.executable, __file__, *argv, "--worker", name, "--weights", str(weights)]
                for name in names}
    return run_in_lockstep(commands, 1 + turns, {**os.environ, "PYTHONWARNINGS": "ignore"})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--side", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per process (the compiled sides "
                                                              "compile in the first)")
    parser.add_argument("--rounds", type=int, default=6, help="processes per side, started alternately")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--turn-steps", type=int, default=4, help="timed steps per turn (a divisor of --steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall-clock or the process's CPU seconds per step")
    parser.add_argument("--compile", choices=("regional", "true"), default="true",
                        help="training.compile of the loongforge-compiled side")
    parser.add_argument("--diffusers-compile", choices=("regional", "full"), default="regional")
    parser.add_argument("--sides", nargs="*", choices=SIDES, default=list(SIDES))
    parser.add_argument("--experts", action="store_true",
                        help="Wan 2.2 A14B's step: two experts, steps alternating between their noise levels")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.worker:
        baton = Baton.from_environment()
        result = worker(args, baton)
        baton.wait_to_finish()
        print(json.dumps(result))
        return {}
    if args.turn_steps < 1 or args.steps % args.turn_steps:
        parser.error(f"--turn-steps {args.turn_steps} must divide --steps {args.steps}")
    names = list(args.sides)
    turn_medians: dict[str, list[float]] = {name: [] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    round_medians: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, list[float]] = {name: [] for name in names}
    rss: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "wan.safetensors"
        write_weights(args, weights)
        for index in range(args.rounds):
            order = names[index % len(names):] + names[:index % len(names)]
            results = run_round(order, raw, weights, args.steps // args.turn_steps)
            for name in names:
                result = results[name]
                steps = [t for turn in result["turns_s"] for t in turn]
                times[name] += steps
                turn_medians[name] += [statistics.median(turn) for turn in result["turns_s"]]
                round_medians[name].append(statistics.median(steps))
                first[name].append(result["first_step_s"])
                rss[name].append(result["peak_rss_mib"])
                print(f"round {index + 1} {name:20s} {round_medians[name][-1] * 1e3:8.2f} ms", flush=True)
    return report(args, names, times, round_medians, turn_medians, first, rss)


def report(args: argparse.Namespace, names: list[str], times: dict[str, list[float]],
           round_medians: dict[str, list[float]], turn_medians: dict[str, list[float]],
           first: dict[str, list[float]], rss: dict[str, list[float]]) -> dict:
    """Print the table and speed-ups; write ``--out``; return the figures."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    speedups = {name: {other: medians[other] / medians[name] for other in medians if other != name}
                for name in medians}
    paired = {name: {other: paired_ratio(turn_medians[other], turn_medians[name]) for other in medians if other != name}
              for name in medians}
    tokens = args.batch * args.frames * (args.side // 2) ** 2
    figures = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("worker", "weights")},
        "tokens_per_step": tokens, "torch": torch.__version__,
        "sides": {name: {"median_step_ms": medians[name] * 1e3, "tokens_per_s": tokens / medians[name],
                         "round_median_ms": [t * 1e3 for t in round_medians[name]],
                         "first_step_s": statistics.median(first[name]),
                         "peak_rss_mib": statistics.median(rss[name])}
                  for name in names},
        "speedup": speedups, "paired_speedup": paired,
    }
    shape = "two experts of " if args.experts else ""
    print(f"\nconfig: {shape}d{args.dim} {args.heads} heads {args.layers} layers, batch {args.batch}, "
          f"{tokens} tokens/step, "
          f"{args.threads} threads, {args.rounds} processes x {args.steps} timed steps per side "
          f"in turns of {args.turn_steps}, {args.clock} clock")
    print(f"{'side':>20} {'median ms':>10} {'round medians ms (min-max)':>28} {'first step s':>13} "
          f"{'peak RSS MiB':>13}")
    for name in names:
        spread = round_medians[name]
        print(f"{name:>20} {medians[name] * 1e3:10.2f} {min(spread) * 1e3:13.2f} - {max(spread) * 1e3:<12.2f} "
              f"{statistics.median(first[name]):13.2f} {statistics.median(rss[name]):13.0f}")
    for name in (n for n in ("loongforge", "loongforge-compiled") if n in names):
        against = ", ".join(f"{speedups[name][other]:.2f}x vs {other} (paired {paired[name][other]:.2f}x)"
                            for other in names if other.startswith("diffusers"))
        print(f"{name}: {against}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
