"""Unknown names and misspelt keys, as the command line reports them: one line that says where the mistake is (the
file or the command line) and what to do -- that a plugin is disabled, or the key that was meant."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.config.sections import ConfigSource
from loongforge.errors import ConfigError
from loongforge.registry import Registry

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def loongforge(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loongforge.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env})


def checked(capsys, *args: str) -> subprocess.CompletedProcess:
    """``loongforge check ARGS`` in this process (what the console script calls; torch is imported once)."""
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["loongforge", "check", *args], code, out, err)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


# -- names of a disabled plugin ---------------------------------------------------------------------------------


@pytest.mark.needs_plugins
@pytest.mark.parametrize("spelling", ["vlm", "loongforge-vlm", "loongforge_vlm", "LoongForge-VLM"])
def test_a_model_of_a_disabled_plugin_says_the_plugin_is_disabled(spelling):
    line = one_error_line(loongforge("check", QUICKSTART, "model.name=qwen2-vl-tiny",
                                     LOONGFORGE_DISABLE_PLUGINS=spelling))
    assert line == ("error: Unknown model 'qwen2-vl-tiny' (model.name in command line (model.name=qwen2-vl-tiny)). "
                    "It is provided by plugin loongforge-vlm, and plugin loongforge-vlm is disabled by "
                    "LOONGFORGE_DISABLE_PLUGINS: remove it from LOONGFORGE_DISABLE_PLUGINS to use it.")
    assert "Did you mean" not in line  # 'qwen3-tiny' looks alike but is not what the user wants


@pytest.mark.needs_plugins
def test_a_plugin_left_out_of_the_allow_list_says_so():
    line = one_error_line(loongforge("check", QUICKSTART, "model.name=qwen2-vl-tiny", LOONGFORGE_LOAD_PLUGINS="cuda"))
    assert "plugin loongforge-vlm is disabled by LOONGFORGE_LOAD_PLUGINS: add 'vlm' to LOONGFORGE_LOAD_PLUGINS" in line


@pytest.mark.needs_plugins
def test_a_disable_list_naming_no_plugin_is_warned_about():
    done = loongforge("list", "devices", LOONGFORGE_DISABLE_PLUGINS="loongforge-vllm,cuda")
    assert done.returncode == 0
    assert ("[loongforge] warning: LOONGFORGE_DISABLE_PLUGINS names no installed plugin: loongforge-vllm "
            "(installed: ") in done.stderr
    assert "loongforge-cuda" not in done.stdout  # the other entry still disabled its plugin
    assert "loongforge-core" in done.stdout


def test_a_name_no_catalog_row_places_keeps_the_did_you_mean_and_lists_the_disabled():
    registry = Registry("model")
    registry.register("qwen3-tiny", object())
    registry.disabled = {"extra": ("extra-models", "LOONGFORGE_DISABLE_PLUGINS")}
    message = registry.unknown_message("qwen3-tinny", "model.name in run.yaml")
    assert message == ("Unknown model 'qwen3-tinny' (model.name in run.yaml). Known: qwen3-tiny. Did you mean "
                       "'qwen3-tiny'? Disabled plugins, which may provide it: 'extra' (LOONGFORGE_DISABLE_PLUGINS).")


# -- overrides are the command line's ---------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("trainng.steps=3", "command line (trainng.steps=3): unknown key 'trainng'"),
    ("training.stepz=3", "command line (training.stepz=3): unknown key 'training.stepz'"),
    ("training.compile=bogus", "command line (training.compile=bogus): 'training.compile' must be true or false or "
                               "one of regional, got 'bogus'"),
    ("training.steps=many", "command line (training.steps=many): 'training.steps' must be an integer, got 'many'"),
    ("steps", "command line: override 'steps': expected key=value"),
])
def test_a_bad_override_is_blamed_on_the_command_line(override, message):
    line = one_error_line(loongforge("train", QUICKSTART, override))
    assert line.startswith(f"error: {message}"), line
    assert "quickstart.yaml" not in line and "<defaults>" not in line


@pytest.mark.parametrize("override,suggestion", [
    ("trainng.steps=3", "did you mean 'training'?"),
    ("training.stepz=3", "did you mean 'steps'?"),
    ("training.compile=regionl", "did you mean 'regional'?"),
    ("training.compile=ture", "did you mean 'true'?"),
])
def test_a_misspelt_override_gets_a_did_you_mean(capsys, override, suggestion):
    assert one_error_line(checked(capsys, QUICKSTART, override)).endswith(suggestion)


def test_a_value_out_of_range_names_the_override_and_a_check_of_settings_together_names_the_file(capsys):
    assert one_error_line(checked(capsys, QUICKSTART, "optimizer.lr=-1")) == (
        "error: command line (optimizer.lr=-1): optimizer.lr must be a finite number >= 0, got -1.0")
    assert one_error_line(checked(capsys, QUICKSTART, "parallel.tp=3", "--nproc", "3")).startswith(
        f"error: {QUICKSTART}: tp=3 must divide the model's attention heads")  # the file's model, the override's tp


def test_a_misspelt_model_name_override_names_the_command_line(capsys):
    line = one_error_line(checked(capsys, QUICKSTART, "model.name=qwen3-tiy"))
    assert line.startswith("error: Unknown model 'qwen3-tiy' (model.name in command line (model.name=qwen3-tiy)).")
    assert line.endswith("Did you mean 'qwen3-tiny'?")


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_a_key_the_file_holds_is_still_the_files(tmp_path):
    path = write(tmp_path, "training:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, ["training.steps=4"])  # a good override beside the file's typo
    assert str(error.value).startswith(f"{path}: unknown key 'training.stepz'")


def test_a_section_check_names_the_file_with_the_overrides_that_shaped_it(tmp_path):
    path = write(tmp_path, "parallel:\n  tp: 2\n")
    source = load_config(path, ["parallel.pp=2", "training.steps=3"]).source
    assert source == path  # it reads as the file wherever a message names config.source
    assert source.of("parallel") == f"{path} with command line (parallel.pp=2)"
    assert source.of("parallel.tp") == path
    assert source.of("parallel.pp") == "command line (parallel.pp=2)"
    assert source.of("training") == "command line (training.steps=3)"  # the file has no training: section
    assert source.of("") == f"{path} with command line (parallel.pp=2, training.steps=3)"


def test_a_missing_path_names_the_override_that_gave_it(capsys, tmp_path):
    missing = tmp_path / "missing.txt"
    assert one_error_line(checked(capsys, QUICKSTART, f"data.paths=[{missing}]")) == (
        f"error: command line (data.paths=[{missing}]): 'data.paths[0]' names {missing}, which does not exist")


def test_the_last_override_of_a_key_is_the_one_blamed(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, ""), ["training.steps=3", "training.steps=x"])
    assert str(error.value) == "command line (training.steps=x): 'training.steps' must be an integer, got 'x'"


def test_the_override_record_survives_copies():
    source = ConfigSource("run.yaml", (("training.steps", "training.steps=3"),), frozenset({"training"}))
    copied = pickle.loads(pickle.dumps(source))
    assert copied == "run.yaml" and copied.of("training.steps") == "command line (training.steps=3)"
