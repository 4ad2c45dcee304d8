"""What the ``diffusion`` plugin adds to the ``loongforge`` command line (registered by
:mod:`loongforge_diffusion.plugin`):

- ``loongforge sample CHECKPOINT --prompt ...``: videos / images from a diffusion checkpoint, with a captioned grid
  and ``index.json`` (:func:`loongforge_diffusion.media.write_samples`);
- ``loongforge cache-latents --vae DIR --text-encoder DIR --videos ... --out DIR``: the Wan VAE latents and
  text-encoder states of captioned videos (:mod:`loongforge_diffusion.data.latents`);
- ``loongforge make-data moving-squares OUT.pt``: a written moving-squares dataset
  (:mod:`loongforge_diffusion.data.moving_squares`).

Torch-free at import: ``loongforge --help`` and ``loongforge make-data --help`` import this module to set up the
arguments; the models, encoders and torch load when a command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loongforge.commands import add_trust_code_option
from loongforge.errors import ConfigError

from loongforge_diffusion.options import SAMPLERS

#: Compute dtypes the latent cache's encoders run in (``--dtype``).
ENCODE_DTYPES = ("float32", "bfloat16")


def configure_sample(sample: argparse.ArgumentParser) -> None:
    sample.add_argument("checkpoint", help="task checkpoint (or its checkpoints root)")
    sample.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    sample.add_argument("--out", default="samples",
                        help="output directory (default ./samples): the samples, grid.gif/grid.png, index.json")
    sample.add_argument("--steps", type=int, default=20, help="sampler steps (default 20)")
    sample.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = off)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the sampling noise (default 0)")
    sample.add_argument("--sampler", choices=SAMPLERS, default="euler",
                        help="euler (default), unipc or dpm++ (UniPC and DPM-Solver++(2M) as diffusers' schedulers "
                             "step, on their noise schedules)")
    sample.add_argument("--format", choices=("gif", "mp4", "png"), default="gif",
                        help="gif (default), mp4 (needs PyAV) or png frames")
    add_trust_code_option(sample)


def run_sample(args: argparse.Namespace) -> int:
    from loongforge.train.task_checkpoint import load_task_model

    from loongforge_diffusion.media import SampleSettings

    _check_sampling(args)
    task, model, _ = load_task_model(args.checkpoint, trust_code=args.trust_code)
    settings = SampleSettings(args.seed, args.steps, args.guidance, args.sampler)
    written = task.sample_files(model, args.prompt, Path(args.out), settings, fmt=args.format)
    for prompt, file in zip(args.prompt, written, strict=True):
        print(f"{file}  <- {prompt!r}")
    print(f"captioned grid and index.json in {args.out}")
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """``--steps``, ``--guidance`` and ``--seed`` held to the ranges ``task.sample`` declares for them, so the command
    refuses what a run config may not hold (a NaN guidance samples black videos and writes a bare NaN into
    index.json)."""
    import dataclasses

    from loongforge.config.sections import RANGE

    from loongforge_diffusion.options import WanSampleOptions

    spans = {f.name: f.metadata[RANGE] for f in dataclasses.fields(WanSampleOptions) if RANGE in f.metadata}
    for name in ("steps", "guidance", "seed"):
        value = getattr(args, name)
        if not spans[name].contains(value):
            raise ConfigError(f"--{name} must be {spans[name].describe(isinstance(value, int))}, got {value!r}")


def configure_cache_latents(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Encode captioned videos into a cache of Wan VAE latents and text-encoder states "
                          "(train on it with task.data=OUT_DIR).")
    parser.add_argument("--vae", required=True, help="a diffusers AutoencoderKLWan directory")
    parser.add_argument("--text-encoder", required=True, help="a transformers UMT5/T5 encoder directory")
    parser.add_argument("--tokenizer", help="the tokenizer directory (default: --text-encoder)")
    parser.add_argument("--videos", required=True, help="a .jsonl of {video, caption}, a directory or a .pt file")
    parser.add_argument("--out", required=True, help="the cache directory to create (must not exist)")
    parser.add_argument("--frames", type=int, help="frames per clip, 1 + 4k (default: the first clip's)")
    parser.add_argument("--height", type=int, help="pixels (default: the first clip's)")
    parser.add_argument("--width", type=int, help="pixels (default: the first clip's)")
    parser.add_argument("--text-len", type=int, default=512, help="caption tokens, padded or truncated (Wan: 512)")
    parser.add_argument("--batch", type=int, default=4, help="clips encoded together")
    parser.add_argument("--shard-size", type=int, default=256, help="samples per shard file")
    parser.add_argument("--device", default="auto", help="where the encoders run (default: cuda if available)")
    parser.add_argument("--dtype", choices=ENCODE_DTYPES, default="float32", help="the encoders' compute dtype")
    parser.add_argument("--i2v", action="store_true",
                        help="also store each clip's image-to-video conditioning: its first frame through the VAE "
                             "behind the first-frame mask, as WanImageToVideoPipeline builds it (I2V flavors)")
    parser.add_argument("--image-encoder",
                        help="with --i2v: a transformers CLIPVisionModel directory with its CLIPImageProcessor, for "
                             "the first frames' CLIP tokens (Wan 2.1 I2V's image branch)")


def run_cache_latents(args: argparse.Namespace) -> int:
    import torch

    from loongforge_diffusion.data.latents import build_cache, load_encoders

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    encoders = load_encoders(args.vae, args.text_encoder, args.tokenizer, device=device, dtype=args.dtype,
                             image_encoder=args.image_encoder)
    index = build_cache(args.videos, encoders, args.out, frames=args.frames, height=args.height, width=args.width,
                        text_len=args.text_len, batch=args.batch, shard_size=args.shard_size, i2v=args.i2v)
    shapes = ", ".join(f"{key} {tuple(shape)}" for key, shape in index["shapes"].items())
    print(f"wrote {index['count']} samples in {len(index['shards'])} shard(s) to {args.out}: {shapes}")
    return 0


def configure_moving_squares(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output file (.pt), read back by task.data=OUT")
    parser.add_argument("--count", type=int, default=512, help="videos (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="data seed: samples are a function of (seed, index)")
    parser.add_argument("--text-dim", type=int, default=32, help="caption state width, the model's text_dim")
    parser.add_argument("--frames", type=int, help="frames per video (default 4)")
    parser.add_argument("--side", type=int, help="frame side in pixels (default 16)")
    parser.add_argument("--speed", type=int, help="pixels the square moves per frame (default 2)")


def run_moving_squares(args: argparse.Namespace) -> int:
    from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, write

    for flag, value in (("--count", args.count), ("--text-dim", args.text_dim)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    shape = {name: value for name, value in (("frames", args.frames), ("side", args.side), ("speed", args.speed))
             if value is not None}
    try:
        geometry = Geometry(**shape)
    except ValueError as exc:
        raise ConfigError(f"--frames/--side/--speed: {exc}") from None
    dataset = MovingSquares(args.count, text_dim=args.text_dim, seed=args.seed, geometry=geometry)
    print(f"wrote {len(dataset)} videos to {write(args.out, dataset)}")
    return 0
