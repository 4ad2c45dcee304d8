"""``loongforge completion bash|zsh|fish``: a shell completion script written from the live parsers.

Why static scripts: completing by running Python on every TAB (argcomplete's way) costs the plugin discovery of a
``loongforge`` start each time and needs a dependency; the commands, sub-commands (``convert`` directions,
``make-data`` generators), options and their choices are known once the plugins are installed, so the script
carries them as tables and completes instantly. Re-run the command after installing or removing a plugin.

:func:`command_tree` reads an :class:`argparse.ArgumentParser` (every command configured) into plain
:class:`Node` values; one renderer per shell turns the tree into a script. The zsh script loads the bash one
through zsh's ``bashcompinit``, so both shells complete from the same tables. Positional arguments complete as
file names. A dispatch point (``eval``, ``convert hf-to-mcore`` ...) completes the options of every installed handler
(:func:`add_handler_options`: which one runs depends on the source), and ``train``, ``check`` and ``plan`` complete
the config's dotted keys as ``KEY=`` (:func:`config_keys`, from the schema) beside file names.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: The shells a script is written for.
SHELLS = ("bash", "zsh", "fish")

PROG = "loongforge"

#: Words the bash tables may hold as they are (inside double quotes): no quote, ``$``, backquote or space.
_SAFE_WORD = re.compile(r"[\w.,:+/@%=-]+")


@dataclass(frozen=True)
class Option:
    """One option of a (sub-)command: its spellings, whether it takes a value, its choices and help."""

    flags: tuple[str, ...]
    takes_value: bool
    choices: tuple[str, ...] = ()
    help: str = ""


@dataclass
class Node:
    """A command or sub-command: ``path`` is the words after ``loongforge`` (``()`` for the top level)."""

    path: tuple[str, ...]
    help: str = ""
    options: list[Option] = field(default_factory=list)
    #: Words that may come next: sub-commands and the choices of a positional argument (``list models``).
    children: dict[str, Node] = field(default_factory=dict)

    def walk(self) -> Iterator[Node]:
        """This node and every node under it, parents first."""
        yield self
        for child in self.children.values():
            yield from child.walk()


def command_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help: str = "") -> Node:
    """The completion tree of ``parser`` (argparse keeps its actions in ``_actions``; there is no public view)."""
    node = Node(path, help)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                node.children[name] = command_tree(sub, (*path, name), helps.get(name, ""))
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            choices = tuple(str(c) for c in action.choices) if action.choices else ()
            node.options.append(Option(tuple(action.option_strings), action.nargs != 0, choices, action.help or ""))
        elif action.choices:  # a positional with choices: each is a word that may come next
            for choice in action.choices:
                node.children.setdefault(str(choice), Node((*path, str(choice))))
    return node


def add_handler_options(tree: Node, registry: Any) -> None:
    """Give each dispatch point's node the options of every handler registered there (``registry``: the plugin
    host's :class:`~loongforge.commands.CommandRegistry`), once each."""
    for point in registry.points():
        node = tree
        for word in point.split():
            node = node.children.get(word, node)
        seen = {flag for option in node.options for flag in option.flags}
        for handler in registry.handlers(point):
            parser = argparse.ArgumentParser(add_help=False)
            handler.configure(parser)
            for option in command_tree(parser).options:
                if not seen & set(option.flags):
                    node.options.append(option)
                    seen.update(option.flags)


def config_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the run config a ``KEY=VALUE`` override may set (``training.steps``, ``model.lora.rank``
    ...): the schema's dataclass fields, sections recursed into, the plugin sections (mappings) as their names."""
    import dataclasses
    import typing

    from loongforge.config.schema import LoongForgeConfig
    from loongforge.config.sections import INTERNAL

    cls = cls or LoongForgeConfig
    keys = []
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if not item.init or item.metadata.get(INTERNAL):  # set by the loader, never by a config
            continue
        kind = hints.get(item.name)
        nested = [arg for arg in (typing.get_args(kind) or (kind,)) if dataclasses.is_dataclass(arg)]
        if nested:
            keys += config_keys(nested[0], f"{prefix}{item.name}.")
        else:
            keys.append(f"{prefix}{item.name}")
    return keys


#: Commands whose positional words after the config are ``KEY=VALUE`` overrides.
OVERRIDE_COMMANDS = ("train", "check", "plan")


def script(tree: Node, shell: str) -> str:
    """The completion script for ``shell`` (one of :data:`SHELLS`)."""
    if shell == "bash":
        return _bash(tree)
    if shell == "zsh":
        return "#compdef loongforge\nautoload -U +X bashcompinit && bashcompinit\n" + _bash(tree)
    if shell == "fish":
        return _fish(tree)
    raise ValueError(f"no completion for shell {shell!r}; choose one of {', '.join(SHELLS)}")


def _key(path: tuple[str, ...]) -> str:
    """How the bash tables name a node: its words after ``loongforge``, each after a space."""
    return "".join(f" {word}" for word in path)


def _bash_case(function: str, rows: list[tuple[str, list[str]]]) -> list[str]:
    """A bash function that echoes the words of the row whose key is its argument (a ``case`` table)."""
    lines = [f"{function}() {{", '    case "$1" in']
    for key, words in rows:
        safe = [word for word in words if _SAFE_WORD.fullmatch(word)]  # a word bash would expand is not offered
        if safe and _SAFE_WORD.fullmatch(key.replace(" ", "").replace("|", "") or "x"):
            lines.append(f'        "{key}") echo "{" ".join(safe)}" ;;')
    return [*lines, "    esac", "}"]


def _bash(tree: Node) -> str:
    nodes = list(tree.walk())
    children = [(_key(n.path), list(n.children)) for n in nodes]
    options = [(_key(n.path), [flag for o in n.options for flag in o.flags]) for n in nodes]
    choices = [(f"{_key(n.path)}|{flag}", list(o.choices)) for n in nodes for o in n.options if o.choices
               for flag in o.flags]
    valued = [(_key(n.path), [flag for o in n.options if o.takes_value and not o.choices for flag in o.flags])
              for n in nodes]
    lines = [f"# {PROG} shell completion (bash); written by `{PROG} completion bash` from the installed plugins.",
             f"# Use: source <({PROG} completion bash)   (or save it as"
             f" ~/.local/share/bash-completion/completions/{PROG})"]
    lines += _bash_case("_loongforge_children", children)
    lines += _bash_case("_loongforge_options", options)
    lines += _bash_case("_loongforge_choices", choices)
    lines += _bash_case("_loongforge_valued", valued)
    keys = [f"{key}=" for key in config_keys()]
    lines += _bash_case("_loongforge_keys", [(f" {command}", keys) for command in OVERRIDE_COMMANDS
                                             if command in tree.children])
    lines += [
        "_loongforge() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" path="" word i',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        word="${COMP_WORDS[i]}"',
        '        if [[ "$word" == -* ]]; then continue; fi',
        '        if [[ " $(_loongforge_valued "$path") " == *" ${COMP_WORDS[i-1]} "* ]]; then continue; fi',
        '        if [[ " $(_loongforge_children "$path") " == *" $word "* ]]; then path="$path $word"; fi',
        "    done",
        '    local words; words="$(_loongforge_choices "$path|$prev")"',
        '    if [[ -z "$words" && " $(_loongforge_valued "$path") " == *" $prev "* ]]; then',
        '        COMPREPLY=($(compgen -f -- "$cur")); return',
        "    fi",
        '    if [[ -z "$words" && "$cur" == -* ]]; then words="$(_loongforge_options "$path")"; fi',
        '    if [[ -z "$words" ]]; then words="$(_loongforge_children "$path")"; fi',
        '    if [[ -z "$words" && "$cur" != -* ]]; then',
        '        local keys; keys=($(compgen -W "$(_loongforge_keys "$path")" -- "$cur"))',
        '        if (( ${#keys[@]} )); then',
        '            COMPREPLY=("${keys[@]}" $(compgen -f -- "$cur")); compopt -o nospace 2>/dev/null; return',
        "        fi",
        "    fi",
        '    if [[ -n "$words" ]]; then COMPREPLY=($(compgen -W "$words" -- "$cur")); else '
        'COMPREPLY=($(compgen -f -- "$cur")); fi',
        "}",
        f"complete -o filenames -F _loongforge {PROG}",
    ]
    return "\n".join(lines) + "\n"


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_condition(node: Node) -> str:
    """Fish's test for "the words typed so far lead to ``node``": each word of its path has been seen."""
    return "; and ".join(f"__fish_seen_subcommand_from {word}" for word in node.path) or "__fish_use_subcommand"


def _fish(tree: Node) -> str:
    lines = [f"# {PROG} shell completion (fish); written by `{PROG} completion fish` from the installed plugins.",
             f"# Use: {PROG} completion fish > ~/.config/fish/completions/{PROG}.fish",
             f"complete -c {PROG} -f"]
    for node in tree.walk():
        seen = _fish_condition(node)
        if node.children:
            nothing_yet = f"not __fish_seen_subcommand_from {' '.join(node.children)}"
            condition = nothing_yet if not node.path else f"{seen}; and {nothing_yet}"
            for name, child in node.children.items():
                lines.append(f"complete -c {PROG} -n {_fish_quote(condition)} -a {name}"
                             + (f" -d {_fish_quote(_first_line(child.help))}" if child.help else ""))
        for option in node.options:
            spelled = " ".join(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}"
                               for flag in option.flags)
            extra = " -r" if option.takes_value else ""
            extra += f" -a {_fish_quote(' '.join(option.choices))}" if option.choices else ""
            extra += " -F" if option.takes_value and not option.choices else ""
            lines.append(f"complete -c {PROG} -n {_fish_quote(seen)} {spelled}{extra}"
                         + (f" -d {_fish_quote(_first_line(option.help))}" if option.help else ""))
    keys = " ".join(f"{key}=" for key in config_keys())
    for command in OVERRIDE_COMMANDS:
        if command in tree.children:
            lines.append(f"complete -c {PROG} -n {_fish_quote(f'__fish_seen_subcommand_from {command}')} -F "
                         f"-a {_fish_quote(keys)}")
    return "\n".join(lines) + "\n"


def _first_line(text: str) -> str:
    """A description short enough for a completion menu: up to the first ``(``, ``;`` or sentence end."""
    for stop in (" (", "; ", ". "):
        text = text.split(stop, 1)[0]
    return text.strip()
