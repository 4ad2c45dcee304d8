"""The ``loongforge`` command line.

``plugins``, ``list`` and ``doctor`` never import torch, so they answer in well under two seconds.
Errors that are the user's to fix (:class:`LoongForgeError`) are printed as one line, without a traceback,
and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from loongforge.errors import ConfigError, LoongForgeError
from loongforge.registry import REGISTRY_KINDS, UnknownComponentError, plural

#: ``loongforge list <plural>`` -> registry kind.
_LIST_CHOICES = {plural(kind): kind for kind in REGISTRY_KINDS}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loongforge", description="LoongForge: train LLM, VLM, diffusion and embodied models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train from a YAML config", description="Train from a YAML config.")
    train.add_argument("config", help="path to the run's YAML config")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. training.steps=50")
    train.add_argument("--device", help="device backend name or 'auto' (beats LOONGFORGE_DEVICE and the config)")
    train.add_argument("--nproc", type=int, help="start this many local processes (as torchrun would)")

    sub.add_parser("plugins", help="list installed plugins and what each registered")

    lister = sub.add_parser("list", help="list registered components of one kind")
    lister.add_argument("kind", choices=sorted(_LIST_CHOICES))

    sub.add_parser("doctor", help="report versions, devices, plugins")

    planner = sub.add_parser("plan", help="choose a parallel layout: top layouts with predicted memory and step time")
    planner.add_argument("config")
    planner.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    planner.add_argument("--devices", type=int, required=True, help="number of devices (ranks)")
    planner.add_argument("--device-memory", help="memory per device, e.g. 80GiB (default: parallel.planner)")
    planner.add_argument("--ranks-per-node", type=int, help="devices per node (default 8)")
    planner.add_argument("--device-tflops", type=float,
                         help="achieved TFLOP/s per device (default: the device backend's; 400 with --device-memory)")
    planner.add_argument("--intra-node-gbps", type=float,
                         help="GB/s per device inside a node (default: the backend's; 450 with --device-memory)")
    planner.add_argument("--inter-node-gbps", type=float,
                         help="GB/s per device across nodes (default: the backend's; 50 with --device-memory)")
    planner.add_argument("--kernels", choices=("te", "local"), default="te",
                         help="activation profile: te (CUDA with Transformer Engine) or local (CPU build)")
    planner.add_argument("--margin", type=float, help="share of memory kept free (default 0.1)")
    planner.add_argument("--calibration", help="calibration file (benchmarks/planner_calibration.py --write)")
    planner.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")

    check = sub.add_parser("check", help="validate a config and resolve its names without training")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*", metavar="KEY=VALUE")

    prep = sub.add_parser("preprocess", help="tokenize .txt/.jsonl files into a memory-mapped token dataset")
    prep.add_argument("inputs", nargs="+", help=".txt or .jsonl files")
    prep.add_argument("--output", required=True, help="output path prefix (writes PREFIX.bin and PREFIX.idx.json)")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or hf:/path/to/local/tokenizer/dir")
    prep.add_argument("--text-key", default="text", help="JSON field with the text in .jsonl files")

    convert = sub.add_parser("convert", help="convert checkpoints between Hugging Face and LoongForge formats")
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = direction.add_parser("hf-to-mcore", help="HF directory -> model-only LoongForge checkpoint")
    to_mcore.add_argument("hf_dir", help="Hugging Face checkpoint directory (config.json + safetensors)")
    to_mcore.add_argument("out_dir", help="new LoongForge checkpoint directory (use it as model.load)")
    to_mcore.add_argument("--model", help="registered model name the checkpoint must match (default: inferred)")
    to_hf = direction.add_parser("mcore-to-hf", help="LoongForge checkpoint (any tp/pp) -> HF directory")
    to_hf.add_argument("checkpoint", help="a checkpoint directory (step-N, a converted one) or a checkpoint root")
    to_hf.add_argument("out_dir", help="new Hugging Face directory")
    to_hf.add_argument("--max-shard-size", default="5GB", help="split safetensors above this size (default 5GB)")

    gen = sub.add_parser("generate", help="continue a prompt with a LoongForge or Hugging Face checkpoint")
    gen.add_argument("checkpoint", help="LoongForge checkpoint (or root) or Hugging Face directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--tokens", type=int, default=64, help="new tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", help="override the checkpoint's tokenizer: byte or hf:/dir")

    sample = sub.add_parser("sample", help="sample videos/images from a diffusion (task) checkpoint")
    sample.add_argument("checkpoint", help="task checkpoint (or its checkpoints root)")
    sample.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    sample.add_argument("--out", default="samples", help="output directory (default ./samples)")
    sample.add_argument("--steps", type=int, default=20, help="sampler steps (default 20)")
    sample.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = off)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--format", choices=("gif", "mp4", "png"), default="gif",
                        help="gif (default), mp4 (needs PyAV) or png frames")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting KEY=VALUE overrides at the first option; accept the ones after it too.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _COMMANDS[args.command](args)
    except LoongForgeError as exc:
        if _reported_here(exc):
            print(f"error: {exc}", file=sys.stderr)
        else:
            time.sleep(2)  # let rank 0 print before the launcher sees this exit and stops the others
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _cmd_train(args: argparse.Namespace) -> int:
    from loongforge.config import load_config
    from loongforge.config.resolve import resolve_names

    config = load_config(args.config, args.overrides)
    resolve_names(config)  # fail on a misspelled name before torch and megatron load
    if args.nproc is not None:
        from loongforge.parallel.launch import launch_local

        device = ["--device", args.device] if args.device else []
        return launch_local(config, args.nproc, ["train", args.config, *args.overrides, *device])
    _quiet_optional_dependency_warnings()

    from loongforge.train.run import run_training

    run_training(config, device=args.device)
    return 0


def _reported_here(exc: LoongForgeError) -> bool:
    """Whether this process prints ``exc``: under torchrun, config and name errors (which every rank hits
    identically) are printed by rank 0 alone; other errors may be one rank's own, so every rank prints them."""
    if isinstance(exc, (ConfigError, UnknownComponentError)):
        return int(os.environ.get("RANK", "0")) == 0
    return True


def _quiet_optional_dependency_warnings() -> None:
    """Hide megatron-core's import-time notices that Apex / Transformer Engine are absent.

    They repeat a dozen times per process on every CPU run and bury the progress output; ``loongforge
    doctor`` reports which optional GPU libraries are installed instead.
    """
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")


def _cmd_check(args: argparse.Namespace) -> int:
    from loongforge.config import load_config
    from loongforge.config.resolve import resolve_names

    config = load_config(args.config, args.overrides)
    for line in resolve_names(config):
        print(line)
    print(f"{args.config}: OK")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from loongforge.plugins import iter_plugins
    from loongforge.report import plugins_table

    plugins_table(list(iter_plugins()))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from loongforge.plugins import get_registry
    from loongforge.report import registry_table

    registry_table(get_registry(_LIST_CHOICES[args.kind]))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from loongforge.planner.cli import plan_command

    return plan_command(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from loongforge.report import doctor

    doctor()
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from loongforge.data.preprocess import preprocess_main

    preprocess_main(args.inputs, args.output, args.tokenizer, args.text_key)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    _quiet_optional_dependency_warnings()
    from loongforge.interop.convert import hf_to_mcore, mcore_to_hf

    if args.direction == "hf-to-mcore":
        print(hf_to_mcore(args.hf_dir, args.out_dir, model=args.model))
    else:
        print(mcore_to_hf(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    _quiet_optional_dependency_warnings()
    from loongforge.interop.generate import generate_from_checkpoint

    print(generate_from_checkpoint(
        args.checkpoint, args.prompt, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, tokenizer=args.tokenizer,
    ))
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    _quiet_optional_dependency_warnings()
    from loongforge.train.task_loop import load_task_model

    task, model, path = load_task_model(args.checkpoint)
    written = task.sample_files(model, args.prompt, Path(args.out), steps=args.steps, guidance=args.guidance,
                                seed=args.seed, fmt=args.format)
    for prompt, file in zip(args.prompt, written, strict=True):
        print(f"{file}  <- {prompt!r}")
    return 0


_COMMANDS = {
    "train": _cmd_train,
    "check": _cmd_check,
    "plugins": _cmd_plugins,
    "list": _cmd_list,
    "doctor": _cmd_doctor,
    "preprocess": _cmd_preprocess,
    "convert": _cmd_convert,
    "generate": _cmd_generate,
    "plan": _cmd_plan,
    "sample": _cmd_sample,
}

if __name__ == "__main__":
    sys.exit(main())
