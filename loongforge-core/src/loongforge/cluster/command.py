"""``loongforge launch SCHEDULER ...``: the one command in front of the scheduler modules.

Why a second parser instead of argparse sub-commands configured up front: configuring a sub-command needs its
module, and only the chosen scheduler's module should be imported (the others may need what this machine lacks).
So ``launch`` takes the scheduler's name and the rest of the line, and :func:`run` imports that scheduler's module,
builds its parser and parses the rest. That parser reports a bad flag as a :class:`~loongforge.errors.ConfigError`,
which the CLI prints as one ``error:`` line (exit 2), like every other mistake a user can make here.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
from typing import NoReturn

from loongforge.commands import CommandRegistry
from loongforge.errors import ConfigError

#: Scheduler name -> (module with ``configure(parser)`` and ``run(args) -> int``, one line of help).
SCHEDULERS: dict[str, tuple[str, str]] = {
    "slurm": ("loongforge.cluster.slurm", "write an sbatch script: one torchrun per node, requeued on preemption"),
    "k8s": ("loongforge.cluster.k8s", "print Kubernetes manifests (JobSet, Kubeflow PyTorchJob or TrainJob)"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are a :class:`ConfigError` (one line from the CLI) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def register_launch_command(commands: CommandRegistry) -> None:
    """Add ``loongforge launch`` (core registers it through ``loongforge_register_commands``, see builtin.py)."""
    commands.add("launch", help="start training on a cluster scheduler (slurm, k8s)", configure=configure, run=run)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Start training on a cluster scheduler. " + "; ".join(
        f"{name}: {text}" for name, (_, text) in SCHEDULERS.items()) + "."
    parser.epilog = "loongforge launch SCHEDULER --help shows that scheduler's options."
    parser.add_argument("scheduler", metavar="SCHEDULER", help=f"one of {', '.join(SCHEDULERS)}")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the scheduler's arguments")


def run(args: argparse.Namespace) -> int:
    if args.scheduler not in SCHEDULERS:
        close = difflib.get_close_matches(args.scheduler, SCHEDULERS, n=1)
        raise ConfigError(f"loongforge launch: unknown scheduler {args.scheduler!r}; known: {', '.join(SCHEDULERS)}"
                          + (f". Did you mean {close[0]!r}?" if close else ""))
    module_name, text = SCHEDULERS[args.scheduler]
    module = importlib.import_module(module_name)
    parser = OneLineErrorParser(prog=f"loongforge launch {args.scheduler}",
                                description=f"{text[:1].upper()}{text[1:]}.")
    module.configure(parser)
    # intermixed: KEY=VALUE overrides may follow the options, as they may after `loongforge train CONFIG --nproc 2`
    return int(module.run(parser.parse_intermixed_args(args.options)) or 0)
