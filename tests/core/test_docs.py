"""Every hook is documented with its exact signature, and exercised by a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import loongforge.hookspecs as hookspecs

ROOT = Path(__file__).resolve().parents[2]


def hook_signatures():
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if name.startswith("loongforge_"):
            yield name, f"{name}({', '.join(inspect.signature(fn).parameters)})"


def test_every_hook_documented_with_exact_signature():
    doc = (ROOT / "docs" / "plugin-authors.md").read_text()
    missing = [sig for _, sig in hook_signatures() if f"`{sig}`" not in doc]
    assert not missing, f"undocumented hooks in docs/plugin-authors.md: {missing}"


def test_every_hook_has_a_test():
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_docs.py")
    untested = [name for name, _ in hook_signatures() if name not in tests]
    assert not untested, f"hooks no test implements: {untested}"
