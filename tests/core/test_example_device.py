"""The example third-party device package (examples/loongforge-example-device) works as a vendor would ship it:
pip-installed with no change to core it is listed, selected by name, trains, records itself in the
checkpoint, passes its own conformance tests, and disappears again when uninstalled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from example_packages import installed_example as installed_example_package
from example_packages import loongforge, pip

# pip-installs into the running environment, which every other test's plugin discovery reads: run apart
# from the parallel suite (nox -s tests runs these after it, in one process)
pytestmark = pytest.mark.venv_install

DIST = "loongforge-example-device"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """The example, copied (so building leaves the repository clean) and pip-installed for this module."""
    with installed_example_package(DIST, tmp_path_factory.mktemp("example")) as source:
        yield source


def test_listed_as_plugin_and_device(installed_example):
    plugins = loongforge("plugins").stdout
    assert DIST in plugins and "example-device" in plugins and "cpu-deterministic" in plugins
    assert "cpu-deterministic" in loongforge("list", "devices").stdout


def test_trains_two_steps_and_checkpoint_records_the_choice(installed_example, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'out'}, seed: 3}}
        model: llama-debug
        device: cpu-deterministic
        data: {{seq_length: 32}}
        training: {{steps: 2, micro_batch_size: 2}}
        logging: {{progress: false, tensorboard: false, interval: 1}}
    """))
    result = loongforge("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device: cpu-deterministic (cpu-deterministic requested by device in" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    metadata = json.loads(next((tmp_path / "out" / "checkpoints").glob("step-*/metadata.json")).read_text())
    assert metadata["device"] == "cpu-deterministic"
    assert metadata["device_reason"].startswith("cpu-deterministic requested by device in")


def test_its_own_conformance_tests_pass(installed_example):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=installed_example, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_uninstall_removes_it(installed_example):
    pip("uninstall", "--yes", DIST)
    try:
        assert DIST not in loongforge("plugins").stdout
        listing = loongforge("list", "devices").stdout
        assert "cpu-deterministic" not in listing and "cpu" in listing
    finally:
        pip("install", "--no-deps", "--no-build-isolation", str(installed_example))  # the fixture removes it


def test_cli_flag_beats_environment_beats_config(installed_example, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'out'}}}
        model: llama-debug
        device: cpu-deterministic
        data: {{seq_length: 32}}
        training: {{steps: 1, micro_batch_size: 1}}
        logging: {{progress: false, tensorboard: false}}
        checkpoint: {{save_at_end: false}}
    """))
    env = {**os.environ, "LOONGFORGE_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), "--device", "cpu-det"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device: cpu-deterministic (cpu-det requested by --device" in result.stdout
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config)],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device: cpu (cpu requested by LOONGFORGE_DEVICE" in result.stdout


def test_it_certifies_itself_against_the_cpu_reference(installed_example, tmp_path):
    """docs/certify.md's vendor walk-through: the out-of-tree backend passes every check at the dp2 layout."""
    result = loongforge("certify", "--device", "cpu-deterministic", "--recipes", "llm", "--layouts", "dp2",
                        "--checks", "train", "modules", "resume", "layouts", "--workdir", str(tmp_path / "certify"),
                        "--output", str(tmp_path / "certificate.json"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    certificate = json.loads((tmp_path / "certificate.json").read_text())
    assert certificate["passed"] and certificate["device"] == "cpu-deterministic"
    assert [check["name"] for check in certificate["checks"]] == [
        "train (1 process)", "modules (one batch)", "resume on device", "layout dp2"]
    assert "verdict: certified" in result.stdout
