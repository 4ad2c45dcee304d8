"""``loongforge completion bash|zsh|fish``: scripts written from the live parsers, checked by the shell itself.

The bash script is parsed by ``bash -n`` and then *used*: each case sources it, sets ``COMP_WORDS`` as bash does
on a TAB and reads ``COMPREPLY`` -- what a user would see offered.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from loongforge.plugins import get_host


def completion(shell: str) -> str:
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "completion", shell], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("completion") / "loongforge.bash"
    path.write_text(completion("bash"))
    return path


def offered(script, *words: str, cwd) -> list[str]:
    """What bash offers after ``loongforge WORDS`` (the last word being the one completed; "" for a new word)."""
    quoted = " ".join(f"'{w}'" for w in ("loongforge", *words))
    program = (f"source '{script}'; COMP_WORDS=({quoted}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); "
               'COMPREPLY=(); _loongforge; printf "%s\\n" "${COMPREPLY[@]}"')
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, cwd=cwd, check=True)
    return [line for line in done.stdout.splitlines() if line]


def test_the_bash_script_parses_and_offers_every_command(bash_script, tmp_path):
    subprocess.run(["bash", "-n", str(bash_script)], check=True)
    names = sorted(command.name for command in get_host().commands().commands())
    assert {"train", "completion", "doctor", "convert"} <= set(names)
    assert sorted(offered(bash_script, "", cwd=tmp_path)) == names


@pytest.mark.parametrize("words,expected", [
    (("conv",), ["convert"]),
    (("convert", "hf"), ["hf-to-mcore"]),
    (("convert", "--trust-code", "mc"), ["mcore-to-hf"]),
    (("train", "run.yaml", "--np"), ["--nproc"]),
    (("plan", "run.yaml", "--kernels", ""), ["te", "local"]),
    (("list", "tok"), ["tokenizers"]),
    (("completion", ""), ["bash", "zsh", "fish"]),
    (("doctor", "--a"), ["--all"]),
    (("--ver",), ["--version"]),
    (("train", "run.yaml", "training.ste"), ["training.steps="]),  # config keys from the schema, as KEY=
    (("check", "run.yaml", "model.lora.ra"), ["model.lora.rank="]),
    (("eval", "ckpt", "--tas"), ["--tasks"]),  # a handler's option (core's lm-eval) at its dispatch point
])
def test_bash_offers_subcommands_options_and_choices(bash_script, tmp_path, words, expected):
    assert offered(bash_script, *words, cwd=tmp_path) == expected


def test_a_value_or_positional_completes_as_a_file_name(bash_script, tmp_path):
    (tmp_path / "run.yaml").write_text("")
    assert offered(bash_script, "train", "run.y", cwd=tmp_path) == ["run.yaml"]
    # a word that may be a file or a config key offers both
    assert offered(bash_script, "train", "ru", cwd=tmp_path) == [
        "run.name=", "run.output_dir=", "run.seed=", "run.trust_code=", "run.yaml"]
    # the value of --prompts-file is a file, and "--prompts-file FILE" is not taken for a sub-command path
    assert offered(bash_script, "generate", "ckpt", "--prompts-file", "r", cwd=tmp_path) == ["run.yaml"]
    assert offered(bash_script, "generate", "ckpt", "--prompts-file", "run.yaml", "--jso", cwd=tmp_path) == ["--jsonl"]


@pytest.mark.needs_plugins
def test_plugin_generators_and_options_complete(bash_script, tmp_path):
    generators = [generator.name for generator in get_host().commands().generators()]
    assert generators, "the first-party plugins add make-data generators"
    assert sorted(offered(bash_script, "make-data", "", cwd=tmp_path)) == sorted(generators)
    assert offered(bash_script, "sample", "ckpt", "--pro", cwd=tmp_path) == ["--prompt"]


def test_zsh_loads_the_same_tables_through_bashcompinit():
    script = completion("zsh")
    head, _, body = script.partition("bashcompinit\n")
    assert head.startswith("#compdef loongforge\nautoload -U +X bashcompinit && ")
    assert body == completion("bash")


def test_fish_declares_every_command_and_its_options():
    lines = completion("fish").splitlines()
    rules = [line for line in lines if not line.startswith("#")]
    assert all(line.startswith("complete -c loongforge ") for line in rules)
    for command in get_host().commands().commands():
        assert any(f" -a {command.name} " in f"{line} " for line in rules), command.name
    nproc = [line for line in rules if " -l nproc" in line]
    assert "complete -c loongforge -n '__fish_seen_subcommand_from train' -l nproc -r -F" in " ".join(nproc)
    kernels = next(line for line in rules if " -l kernels" in line)
    assert "-a 'te local'" in kernels and "__fish_seen_subcommand_from plan" in kernels


def test_an_unknown_shell_is_one_line():
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "completion", "powershell"],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 2 and "invalid choice: 'powershell'" in done.stderr


def test_dispatch_point_help_lists_every_handlers_options(capsys):
    from loongforge.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    shown = capsys.readouterr().out
    assert "options of handler lm-eval (loongforge-core): a LoongForge checkpoint" in shown
    assert "--tasks TASK[,TASK...]" in shown and "--perplexity FILE" in shown
    with pytest.raises(SystemExit):
        main(["convert", "mcore-to-hf", "--help"])
    assert "--max-shard-size" in capsys.readouterr().out
