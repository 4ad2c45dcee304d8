"""LoongForge's Wan DiT vs diffusers' ``WanTransformer3DModel``: training-step time on the same tiny config.

Both models are built from one flavor and hold the same weights (converted); each step is forward, an MSE loss
against a fixed velocity target, backward and an AdamW update, on the same inputs. Steps alternate between the
two models in one process so machine noise hits both alike; the medians after ``--warmup`` steps are compared.
Usage::

    python benchmarks/diffusion_wan_step.py                      # wan-tiny (d64, 2 layers), 4x16x16 video, batch 8
    python benchmarks/diffusion_wan_step.py --dim 256 --heads 4 --layers 4 --side 32 --threads 2

Needs diffusers (``pip install loongforge-diffusion[test]``). Target: ratio ours / diffusers <= 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import WanTransformer3DModel
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, from_diffusers
from loongforge_diffusion.wan.flavors import FLAVORS
from loongforge_diffusion.wan.model import WanModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--side", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    flavor = FLAVORS["wan-tiny"].with_overrides(dim=args.dim, num_heads=args.heads, num_layers=args.layers,
                                                ffn_dim=2 * args.dim)
    reference = WanTransformer3DModel(**diffusers_config(flavor))
    ours = WanModel(flavor)
    ours.load_state_dict(from_diffusers(reference.state_dict()))
    shape = (args.batch, flavor.in_channels, args.frames, args.side, args.side)
    video, target = torch.randn(shape), torch.randn(shape)
    context = torch.randn(args.batch, flavor.text_len, flavor.text_dim)
    timestep = torch.rand(args.batch) * 1000

    def step_fn(model, forward):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> float:
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(forward(model), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return time.perf_counter() - start

        return step

    sides = {
        "loongforge": step_fn(ours, lambda m: m(video, timestep, context)),
        "diffusers": step_fn(reference, lambda m: m(video, timestep, context, return_dict=False)[0]),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(args.warmup + args.steps):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        for name in order:
            elapsed = sides[name]()
            if index >= args.warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    tokens = args.batch * args.frames * (args.side // 2) ** 2
    print(f"config: d{args.dim} {args.heads} heads {args.layers} layers, batch {args.batch}, {tokens} tokens/step, "
          f"{args.threads} threads, {args.steps} timed steps")
    for name, median in medians.items():
        print(f"{name:>10}: median step {median * 1e3:8.2f} ms")
    print(f"ratio loongforge / diffusers: {medians['loongforge'] / medians['diffusers']:.3f}")


if __name__ == "__main__":
    main()
