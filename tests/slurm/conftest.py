"""The Slurm tests' cluster: started outside pytest, by ``tests/slurm/cluster.sh start`` (``nox -s slurm`` starts it,
runs these tests and stops it). The ``slurm`` fixture only checks that it answers, so a test marked ``slurm``
fails with what to do instead of hanging in ``sbatch``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def slurm() -> None:
    """The cluster of tests/slurm/cluster.sh is up: SLURM_CONF names its config and the node is idle."""
    conf = os.environ.get("SLURM_CONF")
    if not conf or not Path(conf).is_file() or shutil.which("sbatch") is None:
        pytest.fail("no Slurm cluster: run `nox -s slurm`, or `tests/slurm/cluster.sh start` and "
                    "SLURM_CONF=/tmp/loongforge-slurm/slurm.conf")
    state = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not state.stdout.strip().startswith("idle"):
        pytest.fail(f"the Slurm node is not idle: {state.stdout.strip() or state.stderr.strip()}")
