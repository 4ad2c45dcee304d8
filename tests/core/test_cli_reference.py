"""docs/cli.md is what the parsers say: regenerated here and compared, so it cannot fall behind a new command or
option. After changing a command: python -m loongforge.cli_reference docs/cli.md"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loongforge import cli_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> str:
    """The reference written by the script, as a user runs it (a fresh process: only installed plugins)."""
    out = tmp_path_factory.mktemp("cli") / "cli.md"
    subprocess.run([sys.executable, "-m", "loongforge.cli_reference", str(out)], check=True, capture_output=True)
    return out.read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.needs_plugins
def test_docs_cli_md_is_the_generated_reference(regenerated):
    assert DOC.read_text(encoding="utf-8") == regenerated, f"docs/cli.md is stale: {cli_reference.REGENERATE}"


@pytest.mark.slow
@pytest.mark.needs_plugins
def test_the_reference_covers_every_command_generator_and_handler(regenerated):
    from loongforge.plugins import get_host

    commands = get_host().commands()
    for command in commands.commands():
        assert f"\n## `loongforge {command.name}`\n" in regenerated, command.name
    for generator in commands.generators():
        assert f"\n### `loongforge make-data {generator.name}`\n" in regenerated, generator.name
    for point in commands.points():
        for handler in commands.handlers(point):
            assert f"\n#### handler `{handler.name}` ({handler.provider})\n" in regenerated, (point, handler.name)
    assert "| `--nproc NPROC` | start this many local processes (as torchrun would) |" in regenerated
    assert "| `--kernels {te,local}` |" in regenerated
    undescribed = [line for line in regenerated.splitlines() if line.startswith("| `") and line.endswith("|  |")]
    assert not undescribed, f"arguments without a help text: {undescribed}"  # every option says what it does


def test_check_names_the_stale_file_and_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_reference, "reference", lambda: "# Command-line reference\n")
    stale = tmp_path / "cli.md"
    stale.write_text("# an old reference\n")
    assert cli_reference.main([str(stale), "--check"]) == 1
    assert capsys.readouterr().err == (f"{stale} is out of date with the installed parsers; regenerate it: "
                                       "python -m loongforge.cli_reference docs/cli.md\n")
    assert cli_reference.main([str(stale)]) == 0 and stale.read_text() == "# Command-line reference\n"
    assert cli_reference.main([str(stale), "--check"]) == 0
