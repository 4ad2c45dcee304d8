"""A third-party plugin, pip-installed from a throwaway package, makes its model usable from YAML.

Nothing in core changes: the package only declares an entry point in the ``loongforge`` group.
Uninstalling it removes it from ``loongforge plugins`` again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-loongforge-test"
version = "0.3.1"
dependencies = []

[project.entry-points.loongforge]
acme = "acme_lf_test.plugin"
"""

PLUGIN = '''
"""Acme's LoongForge plugin: one extra model flavor."""
from loongforge import hookimpl


@hookimpl
def loongforge_register_models(registry):
    registry.register("acme-nano", "acme_lf_test.flavors:NANO", aliases=("acme/nano",),
                      description="Acme nano Llama")
'''

FLAVORS = '''
from loongforge.models.flavor import DecoderFlavor

NANO = DecoderFlavor(family="llama", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                     num_query_groups=1, vocab_size=264, max_position_embeddings=64)
'''


# pip-installs into the running environment, which every other test's plugin discovery reads: run apart
# from the parallel suite (nox -s tests runs these after it, in one process)
pytestmark = pytest.mark.venv_install


def loongforge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "loongforge.cli", *args], capture_output=True, text=True, cwd=cwd)


def pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check", *args], check=True)


@pytest.fixture
def acme_package(tmp_path):
    root = tmp_path / "acme"
    (root / "src" / "acme_lf_test").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "src" / "acme_lf_test" / "__init__.py").write_text("")
    (root / "src" / "acme_lf_test" / "plugin.py").write_text(PLUGIN)
    (root / "src" / "acme_lf_test" / "flavors.py").write_text(FLAVORS)
    pip("install", "--no-deps", "--no-build-isolation", str(root))
    try:
        yield root
    finally:
        pip("uninstall", "--yes", "acme-loongforge-test")


def test_installed_plugin_model_trains_from_yaml(acme_package, tmp_path):
    listing = loongforge("plugins").stdout
    assert "acme-loongforge-test" in listing and "0.3.1" in listing
    assert "acme-nano" in loongforge("list", "models").stdout

    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'out'}, seed: 1}}
        model: acme/nano
        data: {{seq_length: 32}}
        training: {{steps: 3, micro_batch_size: 2}}
        logging: {{progress: false, tensorboard: false, interval: 1}}
        checkpoint: {{save_at_end: false}}
    """))
    result = loongforge("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3


def test_uninstall_removes_plugin(acme_package):
    assert "acme-loongforge-test" in loongforge("plugins").stdout
    pip("uninstall", "--yes", "acme-loongforge-test")
    assert "acme-loongforge-test" not in loongforge("plugins").stdout
    pip("install", "--no-deps", "--no-build-isolation", str(acme_package))  # the fixture uninstalls it again
