"""The ``loongforge`` command line.

Every command -- core's too -- is registered through ``loongforge_register_commands`` (:mod:`loongforge.commands`);
only the chosen command's arguments are configured, so ``plugins``, ``list`` and ``doctor`` never import torch
and answer in well under two seconds.
Errors that are the user's to fix (:class:`LoongForgeError`) are printed as one line, without a traceback,
and exit with status 2; a ``train`` preempted by SIGTERM/SIGUSR1 saves, says so in one line and exits with 3.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
import warnings
from collections.abc import Sequence

from loongforge import __version__ as loongforge_version
from loongforge.commands import DISPATCH_POINTS, CommandRegistry, add_trust_code_option
from loongforge.completion import SHELLS
from loongforge.errors import ConfigError, LoongForgeError, TrainingPreempted
from loongforge.plugins import CORE_PLUGIN, PluginHost, get_host
from loongforge.registry import (
    REGISTRY_KINDS,
    UnknownComponentError,
    disabled_plugins_hint,
    missing_provider_reason,
    plural,
)

#: ``loongforge list <plural>`` -> registry kind.
_LIST_CHOICES = {plural(kind): kind for kind in REGISTRY_KINDS}


def _configure_train(train: argparse.ArgumentParser) -> None:
    train.add_argument("config", help="path to the run's YAML config")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. training.steps=50")
    train.add_argument("--device", help="device backend name or 'auto' (beats LOONGFORGE_DEVICE and the config)")
    train.add_argument("--nproc", type=int, help="start this many local processes (as torchrun would)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="with --nproc: when a process dies, restart all of them up to N times; they resume "
                            "from the newest checkpoint (needs checkpoint.resume: auto)")
    train.add_argument("--dist-timeout", type=int, metavar="SECONDS",
                       help="sets distributed.timeout_s: with several processes, a rank that finishes no step for "
                            "this long ends the run as hung, naming the rank that stopped (exit status 4, which "
                            "--max-restarts restarts); every process group's collectives time out just after it "
                            "(default 1800)")
    add_trust_code_option(train, checkpoint="the checkpoint model.load names (sets run.trust_code)")


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides, with ``--trust-code`` (``train``, ``check``) as ``run.trust_code=true`` and
    ``--dist-timeout`` (``train``) as ``distributed.timeout_s``."""
    timeout = getattr(args, "dist_timeout", None)
    return [*args.overrides, *(["run.trust_code=true"] if args.trust_code else []),
            *([f"distributed.timeout_s={timeout}"] if timeout is not None else [])]


def _configure_list(lister: argparse.ArgumentParser) -> None:
    lister.add_argument("kind", choices=sorted(_LIST_CHOICES), help="what to list")


def _configure_doctor(doctor: argparse.ArgumentParser) -> None:
    doctor.description = ("Report versions, every device backend's probe (why an unavailable one is, and what to do), "
                          "the vendor stack of the available backends, and the plugins.")
    doctor.add_argument("--all", action="store_true", dest="show_all",
                        help="also print the sections of backends that are not available here")


def _configure_completion(completion: argparse.ArgumentParser) -> None:
    completion.description = ("Print a shell completion script for every installed command, sub-command and option "
                              "(written from the installed plugins: run it again after installing one).")
    completion.epilog = ("bash: source <(loongforge completion bash) in ~/.bashrc; zsh: source <(loongforge "
                         "completion zsh) in ~/.zshrc; fish: loongforge completion fish > "
                         "~/.config/fish/completions/loongforge.fish")
    completion.add_argument("shell", choices=SHELLS, help="the shell the script is for")


def _cmd_completion(args: argparse.Namespace) -> int:
    from loongforge.completion import add_handler_options, command_tree, script

    tree = command_tree(full_parser())
    add_handler_options(tree, get_host().commands())
    sys.stdout.write(script(tree, args.shell))
    return 0


def _configure_plan(planner: argparse.ArgumentParser) -> None:
    planner.add_argument("config", help="the run's YAML config")
    planner.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (dotted keys)")
    planner.add_argument("--devices", type=int, required=True, help="number of devices (ranks)")
    planner.add_argument("--device-memory", help="memory per device, e.g. 80GiB (default: parallel.planner)")
    planner.add_argument("--ranks-per-node", type=int, help="devices per node (default 8)")
    planner.add_argument("--device-tflops", type=float,
                         help="achieved TFLOP/s per device (default: the device backend's; 400 with --device-memory)")
    planner.add_argument("--intra-node-gbps", type=float,
                         help="GB/s per device inside a node (default: the backend's; 450 with --device-memory)")
    planner.add_argument("--inter-node-gbps", type=float,
                         help="GB/s per device across nodes (default: the backend's; 50 with --device-memory)")
    planner.add_argument("--host-gbps", type=float,
                         help="GB/s per device to and from host memory, for activation offload (default: the "
                              "backend's; 25 with --device-memory)")
    planner.add_argument("--kernels", choices=("te", "local"), default="te",
                         help="activation profile: te (CUDA with Transformer Engine) or local (CPU build)")
    planner.add_argument("--margin", type=float, help="share of memory kept free (default 0.1)")
    planner.add_argument("--seq-length", type=int, metavar="N",
                         help="plan for sequences of N tokens (data.seq_length=N; default: the config's)")
    planner.add_argument("--sample-shape", metavar="AxBxC",
                         help="task models: one sample's shape in the family's terms (Wan: latent frames x height x "
                              "width, e.g. 21x60x104), for data not at hand (default: parallel.planner.sample_shape, "
                              "then the config's data)")
    planner.add_argument("--calibration", help="calibration file (benchmarks/planner_calibration.py --write)")
    planner.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    planner.add_argument("--write", metavar="FILE",
                         help="write the config with the best layout filled in (parallel sizes, cp_mode, seq_chunks, "
                              "batch cut, recompute, offload) as YAML, runnable with train --nproc DEVICES")


def _configure_check(check: argparse.ArgumentParser) -> None:
    check.description = ("Run every check `loongforge train` runs before it builds anything (names, typed sections, "
                         "layout for --nproc processes, precision on the device, LoRA, files) and print what resolved.")
    check.add_argument("config", help="the run's YAML config")
    check.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (dotted keys), as for train")
    check.add_argument("--nproc", type=int, default=1, help="world size the layout must fit (default 1)")
    check.add_argument("--print-config", action="store_true",
                       help="print the resolved config (bases merged, overrides applied, defaults filled) as YAML "
                            "first: what a run of it records in its checkpoints' config.yaml")
    add_trust_code_option(check, checkpoint="the checkpoint model.load names (sets run.trust_code)")


def _configure_preprocess(prep: argparse.ArgumentParser) -> None:
    prep.description = ("Tokenize text into Megatron-LM's indexed dataset (written with megatron-core's "
                        "IndexedDatasetBuilder), for data.dataset: mmap (alias megatron).")
    prep.add_argument("inputs", nargs="+", help=".txt or .jsonl files, or Hugging Face datasets files on disk "
                                                "(.parquet, .arrow, folders of them, save_to_disk folders)")
    prep.add_argument("--output", required=True, help="output path prefix: writes PREFIX.bin + PREFIX.idx "
                                                      "(Megatron-LM) and PREFIX.loongforge.json (the tokenizer)")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or hf:/path/to/local/tokenizer/dir")
    prep.add_argument("--text-key", default="text",
                      help="JSON field (or column) with the text in .jsonl/parquet inputs")
    prep.add_argument("--txt-split", choices=("paragraph", "line", "file"), default="paragraph",
                      help="what a document of a .txt input is: paragraph (text between blank lines, the default), "
                           "line (every non-blank line) or file (the whole file)")


def _configure_convert(convert: argparse.ArgumentParser) -> None:
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    commands = get_host().commands()
    added = [(c.direction, f"{c.help} [{c.provider}]") for c in commands.conversions()]
    for name, what in (("hf-to-mcore", "another framework's checkpoint -> model-only LoongForge checkpoint"),
                       ("mcore-to-hf", "LoongForge checkpoint (any tp/pp) -> another framework's format"), *added):
        point = f"convert {name}"
        sub = direction.add_parser(name, help=what, description=f"{what}. {_handlers_text(point)}",
                                   epilog="Options after SOURCE OUT belong to the handler that claims SOURCE "
                                          f"(loongforge {point} SOURCE OUT --help shows them).")
        add_trust_code_option(sub)
        _show_handler_options(sub, point)
        sub.add_argument("source", help=commands.points()[point])
        sub.add_argument("out", help="new output directory (or file, where the handler writes one)")
        sub.add_argument("options", nargs=argparse.REMAINDER, help="the claiming handler's options")


def _configure_eval(evaluate: argparse.ArgumentParser) -> None:
    evaluate.description = f"Evaluate a checkpoint with the evaluator of its model. {_handlers_text('eval')}"
    add_trust_code_option(evaluate)
    _show_handler_options(evaluate, "eval")
    evaluate.add_argument("source", help=DISPATCH_POINTS["eval"])
    evaluate.add_argument("options", nargs=argparse.REMAINDER, help="the claiming evaluator's options")


def _configure_generate(gen: argparse.ArgumentParser) -> None:
    gen.description = ("Continue prompts with the model of a LoongForge checkpoint or a Hugging Face directory (built "
                       "on CPU). All prompts are decoded as one batch with a KV cache; greedy unless --temperature > "
                       "0. Prints each prompt and its continuation (with --chat, the reply alone), a blank line "
                       "between prompts, or with --jsonl one JSON object per prompt.")
    gen.add_argument("checkpoint", help="LoongForge checkpoint (or root) or Hugging Face directory")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt; repeat for several (decoded together)")
    gen.add_argument("--prompts-file", metavar="FILE",
                     help='more prompts: one per line, or in a .jsonl file one JSON string, {"prompt": text} or '
                          '(with --chat) {"messages": [{"role", "content"}, ...]} per line')
    gen.add_argument("--max-new-tokens", "--tokens", dest="tokens", type=int, default=64, metavar="N",
                     help="new tokens to generate per prompt (default 64); a prompt stops early at end-of-text")
    gen.add_argument("--chat", action="store_true",
                     help="render each prompt as a user message with the model's chat template (a Hugging Face "
                          "tokenizer's own; for the byte tokenizer LoongForge's) and print the reply")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each conversation")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the end-of-text token: write all N tokens (benchmarks, parity checks)")
    gen.add_argument("--no-kv-cache", action="store_true",
                     help="recompute the whole context for every token (slower; the same tokens)")
    gen.add_argument("--jsonl", action="store_true",
                     help='print {"prompt", "completion", "tokens"} per prompt as JSON lines (the prompt as given '
                          "to the model, the new text, the new token ids)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--seed", type=int, default=0,
                     help="sampling seed (default 0); every prompt samples from its own stream seeded with it, so "
                          "a prompt's text does not depend on the prompts batched with it")
    gen.add_argument("--tokenizer", help="override the checkpoint's tokenizer: byte or hf:/dir")
    for kind in ("image", "video"):
        gen.add_argument(f"--{kind}", action="append", default=[], metavar="PATH",
                         help=f"{kind} file given to every prompt (repeat for several, in order), for models whose "
                              f"family reads {kind}s; the family places it in the text (see the model's guide)")
    add_trust_code_option(gen)


def _configure_make_data(make: argparse.ArgumentParser) -> None:
    make.description = "Write a dataset with one of the installed generators (plugins add them)."
    kinds = make.add_subparsers(dest="generator", required=True, metavar="GENERATOR")
    for generator in get_host().commands().generators():
        sub = kinds.add_parser(generator.name, help=f"{generator.help} [{generator.provider}]",
                               description=f"{generator.help[:1].upper()}{generator.help[1:]}.")
        generator.configure(sub)


def _cmd_make_data(args: argparse.Namespace) -> int:
    chosen = next(g for g in get_host().commands().generators() if g.name == args.generator)
    return chosen.run(args)


def _show_handler_options(parser: argparse.ArgumentParser, point: str) -> None:
    """Make ``--help`` of dispatch point ``point`` end with every handler's own options. Why at print time: a handler's
    options are set up by its (lazily imported) module, which only ``--help`` needs, not every ``loongforge`` start."""
    plain = parser.format_help

    def format_help() -> str:
        sections = [plain()]
        for handler in get_host().commands().handlers(point):
            options = argparse.ArgumentParser(prog=handler.name, add_help=False)
            handler.configure(options)
            listed = options.format_help().split("\n\n", 1)[-1].removeprefix("options:\n")  # no usage line
            sections.append(f"options of handler {handler.name} ({handler.provider}): {handler.accepts}\n{listed}")
        return "\n".join(sections)

    parser.format_help = format_help  # type: ignore[method-assign]


def _handlers_text(point: str) -> str:
    handlers = get_host().commands().handlers(point)
    listed = "; ".join(f"{h.name} ({h.provider}): {h.accepts}" for h in handlers) or "none installed"
    return f"Handlers: {listed}."


def register_core_commands(commands: CommandRegistry) -> None:
    """Core's own commands, added through ``loongforge_register_commands`` like any plugin's (see builtin.py)."""
    commands.add("train", help="train from a YAML config", configure=_configure_train, run=_cmd_train)
    commands.add("plugins", help="list installed plugins and what each registered", run=_cmd_plugins)
    commands.add("list", help="list registered components of one kind", configure=_configure_list, run=_cmd_list)
    commands.add("doctor", help="report versions, devices, plugins", configure=_configure_doctor, run=_cmd_doctor)
    commands.add("completion", help="print a bash, zsh or fish completion script", configure=_configure_completion,
                 run=_cmd_completion)
    commands.add("plan", help="choose a parallel layout: top layouts with predicted memory and step time",
                 configure=_configure_plan, run=_cmd_plan)
    commands.add("check", help="run every pre-flight check of train without building anything",
                 configure=_configure_check, run=_cmd_check)
    commands.add("preprocess", help="tokenize text/jsonl/parquet into a Megatron-LM .bin/.idx dataset",
                 configure=_configure_preprocess, run=_cmd_preprocess)
    commands.add("convert", help="convert checkpoints to and from LoongForge, and what plugins add (the handler "
                                 "claiming the source)",
                 configure=_configure_convert, run=_cmd_convert)
    commands.add("eval", help="evaluate a checkpoint (the evaluator of its model)", configure=_configure_eval,
                 run=_cmd_eval)
    commands.add("make-data", help="write a synthetic or recorded dataset (generators the plugins add)",
                 configure=_configure_make_data, run=_cmd_make_data)
    commands.add_generator("preference-pairs", help="write generated preference pairs (right vs wrong answers) to a "
                           ".jsonl for training.phase dpo", configure="loongforge.data.preference_pairs:configure",
                           run="loongforge.data.preference_pairs:run")
    commands.add_generator("verifiable-tasks", help="write generated prompts with checkable answers (letter counts, "
                           "facts of the shipped novels; sums, capitals, backwards spelling) to a .jsonl for "
                           "training.phase grpo",
                           configure="loongforge.data.verifiable_tasks:configure",
                           run="loongforge.data.verifiable_tasks:run")
    commands.add("generate", help="continue prompts (or chat) with a LoongForge or Hugging Face checkpoint",
                 configure=_configure_generate, run=_cmd_generate)
    commands.add("plot", help="draw loss/lr/throughput curves of one or several runs into a PNG",
                 configure="loongforge.plot:configure", run="loongforge.plot:run")
    commands.add("diff", help="find where two runs, checkpoints or Hugging Face directories part",
                 configure="loongforge.diffing.command:configure", run="loongforge.diffing.command:run")
    commands.add("certify", help="prove a device backend trains as the CPU reference does (a certificate)",
                 configure="loongforge.certify.command:configure", run="loongforge.certify.command:run")


#: ``_parser(chosen=EVERY_COMMAND)`` configures every command (completion scripts, the CLI reference).
EVERY_COMMAND = "*"


def _parser(host: PluginHost, commands: CommandRegistry, chosen: str | None) -> argparse.ArgumentParser:
    """The top-level parser: every registered command (with its provider) as a sub-command; only ``chosen``'s
    arguments are configured (all with :data:`EVERY_COMMAND`), so one command's (possibly heavy) module is the
    only one imported when a command runs."""
    parser = argparse.ArgumentParser(
        prog="loongforge", formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps --version's lines
        description="LoongForge: train models on megatron-core; plugins add models, devices and commands.",
    )
    parser.add_argument("--version", action="version", version=_versions(host),
                        help="print loongforge-core's version and every plugin's")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands.commands():
        command_parser = sub.add_parser(command.name, help=f"{command.help} [{command.provider}]",
                                        description=f"{command.help[:1].upper()}{command.help[1:]}.")
        if chosen in (command.name, EVERY_COMMAND):
            command.configure(command_parser)
    return parser


def full_parser() -> argparse.ArgumentParser:
    """The parser with every installed command configured: what completion and the CLI reference describe.
    Commands configure torch-free (registration's rule), so this imports no framework."""
    host = get_host()
    return _parser(host, host.commands(), EVERY_COMMAND)


def _versions(host: PluginHost) -> str:
    lines = [f"loongforge-core {loongforge_version}"]
    lines += [f"  {info.name}: {info.distribution} {info.version}" for info in host.plugins.values()
              if info.name != CORE_PLUGIN]
    return "\n".join(lines)


def _unknown_command(argv: list[str], commands: CommandRegistry, host: PluginHost) -> str | None:
    """One line for a command nobody registered: the known ones, a did-you-mean, and which first-party plugin
    provides it when that one is not installed or disabled."""
    if not argv or argv[0].startswith("-") or commands.command(argv[0]) is not None:
        return None
    reason = missing_provider_reason("command", argv[0], host.disabled)
    if reason is not None:
        return f"Unknown command '{argv[0]}'. {reason}"
    known = [command.name for command in commands.commands()]
    parts = [f"Unknown command '{argv[0]}'. Known: {', '.join(known)}."]
    close = difflib.get_close_matches(argv[0], known, n=1)
    if close:
        parts.append(f"Did you mean '{close[0]}'?")
    parts += disabled_plugins_hint(host.disabled)
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        host = get_host()
        commands = host.commands()
        unknown = _unknown_command(argv, commands, host)
        if unknown is not None:
            raise LoongForgeError(unknown)
        parser = _parser(host, commands, argv[0] if argv and not argv[0].startswith("-") else None)
        args, extra = parser.parse_known_args(argv)
        # argparse stops collecting KEY=VALUE overrides at the first option; accept the ones after it too.
        if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        command = commands.command(args.command)
        assert command is not None  # argparse only accepts registered names
        _quiet_optional_dependency_warnings()  # for every command's megatron imports, plugins' included
        return command.run(args)
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
    from loongforge.resolve import resolve_names

    overrides = _overrides(args)
    config = load_config(args.config, overrides)
    resolve_names(config)  # fail on a misspelled name before torch and megatron load
    if args.nproc is not None:
        from loongforge.parallel.launch import launch_local

        device = ["--device", args.device] if args.device else []
        return launch_local(config, args.nproc, ["train", args.config, *overrides, *device],
                            max_restarts=args.max_restarts)
    if args.max_restarts:
        raise ConfigError("--max-restarts restarts the processes that --nproc starts; under torchrun, give torchrun "
                          "its own --max-restarts")

    from loongforge.train.run import run_training

    try:
        run_training(config, device=args.device)
    except TrainingPreempted as exc:  # saved and stopped on a signal: not an error, a status to requeue on
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[loongforge] {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # as for errors: rank 0 prints before the launcher sees this exit and stops the others
        return exc.exit_status
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
    from loongforge.train.preflight import preflight

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    config = load_config(args.config, _overrides(args))
    if args.print_config:
        import yaml

        from loongforge.config.loader import config_to_dict

        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    for line in preflight(config, nproc=args.nproc):
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

    doctor(show_all=args.show_all)
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from loongforge.data.preprocess import preprocess_main

    preprocess_main(args.inputs, args.output, args.tokenizer, args.text_key, txt_split=args.txt_split)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    return _run_handler(f"convert {args.direction}", args, source=args.source, out=args.out)


def _cmd_eval(args: argparse.Namespace) -> int:
    return _run_handler("eval", args, source=args.source)


def _run_handler(point: str, point_args: argparse.Namespace, **fixed: str) -> int:
    """Run the handler of ``point`` that claims ``fixed["source"]``, with its own options parsed from
    ``point_args.options`` and the point's arguments (``source``, ``out``, ``trust_code``) set on the namespace it
    receives. ``--trust-code`` is the point's wherever it stands, before SOURCE or among the handler's options: the
    claims need it before the handler is known."""
    from loongforge.hf_dirs import looks_like_hub_id, resolve_hub_directory

    options = [option for option in point_args.options if option != "--trust-code"]
    trust_code = point_args.trust_code or len(options) < len(point_args.options)
    if looks_like_hub_id(fixed["source"]):  # its local snapshot; anything else (a path, ws://...) is kept as given
        fixed["source"] = str(resolve_hub_directory(fixed["source"], what="SOURCE"))
    handler = get_host().commands().handler_for(point, fixed["source"], trust_code=trust_code)
    parser = argparse.ArgumentParser(prog=f"loongforge {point} {' '.join(k.upper() for k in fixed)}",
                                     description=f"{handler.name} ({handler.provider}): {handler.accepts}")
    handler.configure(parser)
    args = parser.parse_args(options)
    for key, value in fixed.items():
        setattr(args, key, value)
    args.trust_code = trust_code
    return handler.run(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    import json

    from loongforge.interop.generate import complete_from_checkpoint, read_prompts

    prompts = [*args.prompt, *(read_prompts(args.prompts_file) if args.prompts_file else [])]
    if not prompts:
        raise ConfigError("loongforge generate needs a prompt: --prompt TEXT or --prompts-file FILE")
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat message: use it with --chat")
    completions = complete_from_checkpoint(
        args.checkpoint, prompts, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, tokenizer=args.tokenizer, trust_code=args.trust_code, chat=args.chat,
        system=args.system, ignore_eos=args.ignore_eos, use_cache=not args.no_kv_cache,
        media={"image": args.image, "video": args.video},
    )
    for index, completion in enumerate(completions):
        if args.jsonl:
            print(json.dumps({"prompt": completion.prompt, "completion": completion.text, "tokens": completion.ids},
                             ensure_ascii=False))
            continue
        if index:
            print()
        print(completion.text if args.chat else completion.prompt + completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
