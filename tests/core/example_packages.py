"""Installing the example plugin packages (examples/loongforge-example-*) the way their users do, for the tests
that prove them: a copy (so building leaves the repository clean), ``pip install``, and ``pip uninstall`` after."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def loongforge(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """The ``loongforge`` command in a fresh process (plugins discovered as a user's shell would)."""
    return subprocess.run([sys.executable, "-m", "loongforge.cli", *args], capture_output=True, text=True, **kwargs)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check", *args], check=True)


@contextlib.contextmanager
def installed_example(name: str, workdir: Path) -> Iterator[Path]:
    """``examples/<name>`` copied under ``workdir`` and pip-installed (distribution ``name``) while in the block;
    yields the copy."""
    source = workdir / "pkg"
    shutil.copytree(EXAMPLES / name, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip("install", "--no-deps", "--no-build-isolation", str(source))
    try:
        yield source
    finally:
        pip("uninstall", "--yes", name)


def plugin_site(root: Path, module: str, source: str) -> Path:
    """``root`` holding the one-module plugin ``module`` (``source``) as an installed distribution -- a
    ``.dist-info`` with a ``loongforge`` entry point -- so that every process with ``root`` on ``PYTHONPATH``
    discovers it the way it discovers a pip-installed plugin (the ranks torchrun starts included)."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[loongforge]\n{module} = {module}\n")
    return root
