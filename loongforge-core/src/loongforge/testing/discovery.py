"""Discovery checks every plugin's test suite runs: installed means listed by ``loongforge plugins``."""

from __future__ import annotations

import os
import subprocess
import sys


def plugins_listing(env: dict[str, str] | None = None) -> str:
    """The output of ``loongforge plugins`` in a fresh interpreter (so nothing cached in-process counts)."""
    result = subprocess.run(
        [sys.executable, "-m", "loongforge.cli", "plugins"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return result.stdout


def assert_discovered(plugin: str, distribution: str, version: str) -> None:
    """Assert ``plugin`` is listed with its distribution and version, and that blocking it hides it."""
    rows = [line for line in plugins_listing().splitlines() if f" {plugin} " in line]
    assert rows, f"plugin '{plugin}' is not listed by `loongforge plugins`"
    assert distribution in rows[0] and version in rows[0], rows[0]
    hidden = plugins_listing({"LOONGFORGE_DISABLE_PLUGINS": plugin})
    assert distribution not in hidden, f"LOONGFORGE_DISABLE_PLUGINS={plugin} did not hide it"
