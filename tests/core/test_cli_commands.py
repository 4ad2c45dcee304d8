"""``loongforge_register_commands``: plugins add sub-commands and dispatch handlers to the one ``loongforge`` CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from loongforge import hookimpl
from loongforge.cli import main


class Hello:
    """An in-process plugin with a command of its own and a converter for ``*.hello`` files."""

    def __init__(self) -> None:
        self.ran: list[argparse.Namespace] = []

    @hookimpl
    def loongforge_register_commands(self, commands):
        commands.add("hello", help="greet someone", configure=self.configure, run=self.run)
        commands.add_handler("convert hf-to-mcore", "hello-files", accepts="a *.hello file",
                             claims=lambda source, trust_code: source.endswith(".hello"), configure=self.configure,
                             run=self.run)

    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--name", required=True)

    def run(self, args: argparse.Namespace) -> int:
        self.ran.append(args)
        print(f"hello {args.name}")
        return 7


def test_a_plugin_command_runs_with_its_arguments(register_plugin, capsys):
    plugin = register_plugin(Hello(), "hello")
    assert main(["hello", "--name", "world"]) == 7
    assert capsys.readouterr().out == "hello world\n" and plugin.ran[0].name == "world"


def test_convert_runs_the_handler_that_claims_the_source(register_plugin, capsys, tmp_path):
    plugin = register_plugin(Hello(), "hello")
    source = str(tmp_path / "a.hello")
    assert main(["convert", "hf-to-mcore", source, str(tmp_path / "out"), "--name", "file"]) == 7
    ran = plugin.ran[0]
    assert (ran.source, ran.out, ran.name) == (source, str(tmp_path / "out"), "file")


def test_unknown_convert_source_is_one_line_listing_every_handler(register_plugin, capsys, tmp_path):
    register_plugin(Hello(), "hello")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "a.txt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no registered handler claims '{tmp_path / 'a.txt'}'" in err, err
    assert "hello-files (<in-process>): a *.hello file" in err
    assert "hf-model (loongforge-core): a Hugging Face directory whose config.json architecture" in err


class HelloToText:
    """An in-process plugin adding a conversion direction core does not know, with one handler."""

    def __init__(self) -> None:
        self.hello = Hello()

    @hookimpl
    def loongforge_register_commands(self, commands):
        commands.add_conversion("hello-to-text", help="*.hello files -> text", source="a *.hello file")
        commands.add_handler("convert hello-to-text", "hello-files", accepts="a *.hello file",
                             claims=lambda source, trust_code: source.endswith(".hello"),
                             configure=self.hello.configure, run=self.hello.run)


def test_a_plugin_adds_a_conversion_direction(register_plugin, capsys, tmp_path):
    plugin = register_plugin(HelloToText(), "hello-to-text")
    source = str(tmp_path / "a.hello")
    assert main(["convert", "hello-to-text", source, str(tmp_path / "out"), "--name", "file"]) == 7
    assert (plugin.hello.ran[0].source, plugin.hello.ran[0].name) == (source, "file")
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "*.hello files -> text [<in-process>]" in capsys.readouterr().out


@pytest.mark.parametrize("direction", ["hf-to-mcore", "hello-to-text"])
def test_a_conversion_direction_taken_twice_fails_naming_both(register_plugin, capsys, direction):
    class Clash:
        @hookimpl
        def loongforge_register_commands(self, commands):
            commands.add_conversion(direction, help="again", source="anything")

    if direction == "hello-to-text":
        register_plugin(HelloToText(), "hello-to-text")
    register_plugin(Clash(), "clash")
    assert main(["plugins"]) == 2
    owner = "loongforge-core" if direction == "hf-to-mcore" else "<in-process>"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"conversion 'convert {direction}' registered twice: by {owner} and by " in err


def test_duplicate_command_names_fail_naming_both_providers(register_plugin, capsys):
    class Clash:
        @hookimpl
        def loongforge_register_commands(self, commands):
            commands.add("train", help="mine", run=lambda args: 0)

    register_plugin(Clash(), "clash")
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plugin 'clash'" in err
    assert "command 'train' registered twice: by loongforge-core and by <in-process>" in err


def test_help_lists_every_command_with_its_provider(register_plugin, capsys):
    register_plugin(Hello(), "hello")
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help column
    assert "hello greet someone [<in-process>]" in out
    assert "train train from a YAML config [loongforge-core]" in out


@pytest.mark.needs_plugins
def test_help_lists_first_party_plugin_commands_in_a_fresh_process():
    env = {**os.environ, "COLUMNS": "300"}  # one line per command
    lines = subprocess.run([sys.executable, "-m", "loongforge.cli", "--help"], capture_output=True, text=True,
                           check=True, env=env).stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if line.startswith("    ") and line.strip()}
    for command, provider in (("sample", "loongforge-diffusion"), ("serve", "loongforge-embodied"),
                              ("collect", "loongforge-embodied"), ("eval", "loongforge-core"),
                              ("convert", "loongforge-core")):
        assert rows[command].endswith(f"[{provider}]"), rows.get(command)


@pytest.mark.needs_plugins
def test_version_prints_core_and_every_plugin():
    from importlib_metadata import version

    out = subprocess.run([sys.executable, "-m", "loongforge.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == f"loongforge-core {version('loongforge-core')}"
    assert f"  vlm: loongforge-vlm {version('loongforge-vlm')}" in out
    assert f"  embodied: loongforge-embodied {version('loongforge-embodied')}" in out


@pytest.mark.needs_plugins
def test_a_disabled_plugins_command_says_it_is_disabled():
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "sample", "ckpt", "--prompt", "x"],
                          capture_output=True, text=True, env={**os.environ, "LOONGFORGE_DISABLE_PLUGINS": "diffusion"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Unknown command 'sample'" in done.stderr
    assert "It is provided by plugin loongforge-diffusion, and plugin loongforge-diffusion is disabled by " \
           "LOONGFORGE_DISABLE_PLUGINS" in done.stderr


def test_plugin_commands_are_registered_by_import_path_and_stay_torch_free():
    code = ("import sys; from loongforge.plugins import get_host; names = [c.name for c in get_host().commands()"
            ".commands()]; heavy = [m for m in ('torch', 'megatron') if m in sys.modules]; "
            "print(__import__('json').dumps([names, heavy]))")
    names, heavy = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout)
    assert {"train", "check", "convert", "eval", "generate"} <= set(names) and heavy == []
