"""The CLI reference (``docs/cli.md``), written from the live parsers so that it cannot drift from them.

``python -m loongforge.cli_reference docs/cli.md`` rewrites the file; ``--check`` exits 1 (naming the file and
the regenerate command) when the file differs from what the parsers say now. It walks the parser of every
installed command (:func:`loongforge.cli.full_parser`) -- sub-commands such as ``convert``'s directions,
``list``'s kinds and ``make-data``'s generators included -- and, under each dispatch point, every handler with the
options it parses after ``SOURCE OUT``. Building the handlers' parsers imports their plugins' modules (torch
among them), which is why this is a script and not part of ``loongforge --help``.

The text depends only on the installed plugins and their parsers: help is formatted at a fixed width, and no
version, path or machine figure is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from loongforge.cli import full_parser
from loongforge.commands import Handler
from loongforge.plugins import get_host

#: Where usage lines wrap (argparse would otherwise follow the terminal's width).
WIDTH = 100

REGENERATE = "python -m loongforge.cli_reference docs/cli.md"


def _fixed_width(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` formatting at :data:`WIDTH` columns, whatever the terminal (reproducible output)."""
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return parser


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An action's help with argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)  # argparse offers no public way to expand help


def _spelling(action: argparse.Action) -> str:
    """``--nproc N`` / ``config`` / ``{a,b}``: how the argument is written, as in ``--help``."""
    if not action.option_strings:
        return action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else action.dest.upper())
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:  # argparse keeps its actions here; there is no public view
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        text = _help(parser, action)
        if action.choices and not isinstance(action.choices, dict):
            text += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append(f"| `{_cell(_spelling(action))}` | {_cell(text)} |")
    if not rows:
        return []
    return ["| argument | description |", "| --- | --- |", *rows, ""]


def _usage(parser: argparse.ArgumentParser) -> list[str]:
    return ["```text", _fixed_width(parser).format_usage().strip(), "```", ""]


def _section(parser: argparse.ArgumentParser, title: str, summary: str, level: int) -> list[str]:
    """One (sub-)command: heading, what it does, usage, its arguments, then its sub-commands one level down."""
    lines = [f"{'#' * level} `{title}`", ""]
    description = parser.description or summary
    if description:
        lines += [" ".join(description.split()), ""]
    lines += _usage(parser)
    lines += _arguments_table(parser)
    if parser.epilog:
        lines += [" ".join(parser.epilog.split()), ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                lines += _section(sub, f"{title} {name}", helps.get(name, ""), level + 1)
    return lines


def _handler_section(handler: Handler, level: int) -> list[str]:
    """A dispatch point's handler: what it claims, and the options it parses after the point's arguments."""
    parser = _fixed_width(argparse.ArgumentParser(prog=f"loongforge {handler.point} SOURCE ...", add_help=False))
    handler.configure(parser)
    lines = [f"{'#' * level} handler `{handler.name}` ({handler.provider})", "", _cell(handler.accepts), ""]
    table = _arguments_table(parser)
    return lines + (table or ["No options of its own.", ""])


def reference() -> str:
    """The whole reference as markdown."""
    parser = _fixed_width(full_parser())
    commands = get_host().commands()
    lines = ["# Command-line reference", "",
             f"Generated from the parsers of the installed plugins by `{REGENERATE}`; do not edit by hand "
             "(tests/core/test_cli_reference.py regenerates it and fails when this file differs).", "",
             "| command | what it does | provided by |", "| --- | --- | --- |"]
    lines += [f"| [`{c.name}`](#loongforge-{c.name}) | {_cell(c.help)} | {c.provider} |" for c in commands.commands()]
    lines += ["", *_usage(parser)]
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in commands.commands():
        lines += _section(subcommands.choices[command.name], f"loongforge {command.name}", command.help, 2)
        points = commands.points()
        for point in (p for p in points if p.split()[0] == command.name):
            handlers = commands.handlers(point)
            lines += [f"### Handlers of `{point}`", "", _cell(f"SOURCE is {points[point]}; the first handler "
                                                              "(in this order) that claims it runs."), ""]
            for handler in handlers:
                lines += _handler_section(handler, 4)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m loongforge.cli_reference", description=__doc__.splitlines()[0])
    cli.add_argument("path", type=Path, help="the markdown file to write (docs/cli.md)")
    cli.add_argument("--check", action="store_true", help="do not write: exit 1 when the file is out of date")
    args = cli.parse_args(argv)
    text = reference()
    if args.check:
        if not args.path.is_file() or args.path.read_text(encoding="utf-8") != text:
            print(f"{args.path} is out of date with the installed parsers; regenerate it: {REGENERATE}",
                  file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
