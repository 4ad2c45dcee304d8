"""``loongforge sample``: videos / images from a diffusion checkpoint (registered by
:mod:`loongforge_diffusion.plugin`).

Torch-free at import: ``loongforge --help`` imports this module only to list the command; the checkpoint and the
model load when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loongforge.commands import add_trust_code_option


def configure_sample(sample: argparse.ArgumentParser) -> None:
    sample.add_argument("checkpoint", help="task checkpoint (or its checkpoints root)")
    sample.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    sample.add_argument("--out", default="samples", help="output directory (default ./samples)")
    sample.add_argument("--steps", type=int, default=20, help="sampler steps (default 20)")
    sample.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = off)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--format", choices=("gif", "mp4", "png"), default="gif",
                        help="gif (default), mp4 (needs PyAV) or png frames")
    add_trust_code_option(sample)


def run_sample(args: argparse.Namespace) -> int:
    from loongforge.train.task_loop import load_task_model

    task, model, _ = load_task_model(args.checkpoint, trust_code=args.trust_code)
    written = task.sample_files(model, args.prompt, Path(args.out), steps=args.steps, guidance=args.guidance,
                                seed=args.seed, fmt=args.format)
    for prompt, file in zip(args.prompt, written, strict=True):
        print(f"{file}  <- {prompt!r}")
    return 0
