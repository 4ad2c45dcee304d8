"""The CLI as a user meets it: fast listings without torch, one-line errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "loongforge.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("command", [
    ["plugins"], ["list", "models"], ["list", "devices"], ["list", "datasets"],
    # no training: an LLM run's checks (the data opened as training opens it), a layout plan, a generated dataset
    ["check", str(CONFIGS / "quickstart.yaml")], ["check", str(CONFIGS / "sft-tiny.yaml")],
    ["plan", str(CONFIGS / "quickstart.yaml"), "--devices", "8"], ["make-data", "verifiable-tasks", "tasks.jsonl"],
], ids=lambda command: " ".join(Path(part).name for part in command))
def test_commands_that_train_nothing_never_import_torch(command, tmp_path):
    """Each costs a fraction of a second rather than the seconds of importing torch and megatron-core
    (benchmarks/startup.py measures it)."""
    code = (
        f"import sys; from loongforge.cli import main; rc = main({command!r}); "
        "heavy = [m for m in ('torch', 'megatron') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_import_loongforge_is_light():
    code = "import sys, loongforge; assert 'torch' not in sys.modules and 'megatron' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_list_models_shows_flavors_and_providers():
    out = run_cli("list", "models").stdout
    for name in ("llama-tiny", "llama3-8b", "qwen3-0.6b", "qwen2.5-7b"):
        assert name in out
    assert "loongforge-core" in out


def one_line_error(result):
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_misspelled_model_is_one_line_with_suggestion(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: lama-tiny\n")
    line = one_line_error(run_cli("train", str(config)))
    assert "Unknown model 'lama-tiny'" in line and str(config) in line
    assert "Known: " in line and "llama-tiny" in line and "Did you mean 'llama-tiny'?" in line


def test_unknown_key_names_file_and_key(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: llama-tiny\ntraining:\n  learning_rate: 0.1\n")
    line = one_line_error(run_cli("train", str(config)))
    assert str(config) in line and "'training.learning_rate'" in line


def test_unknown_device_and_missing_plugin_hint(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("device: kunlun\n")
    line = one_line_error(run_cli("check", str(config), env={"LOONGFORGE_DISABLE_PLUGINS": "xpu"}))
    assert line == (f"error: Unknown device 'kunlun' (device in {config}). It is provided by plugin loongforge-xpu, "
                    "and plugin loongforge-xpu is disabled by LOONGFORGE_DISABLE_PLUGINS: remove it from "
                    "LOONGFORGE_DISABLE_PLUGINS to use it.")


def test_check_resolves_every_name(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: Qwen/Qwen3-0.6B\ndevice: cpu\n")
    result = run_cli("check", str(config))
    assert result.returncode == 0, result.stderr
    assert "model: qwen3-0.6b (from loongforge-core)" in result.stdout
    assert "device: cpu (from loongforge-core)" in result.stdout


def test_doctor_reports_cpu_backend():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert "cpu" in result.stdout and "megatron-core" in result.stdout
