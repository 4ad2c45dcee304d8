"""Every hook is documented with its exact signature, and exercised by a test."""

from __future__ import annotations

import inspect
import re
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


#: A hook implementation: ``@hookimpl`` (with or without options) right above ``def loongforge_<hook>(``, in a test
#: module or in plugin source a test writes out (a string in a test file counts: the test runs that plugin).
_IMPLEMENTATION = re.compile(r"@hookimpl\b[^\n]*\n\s*def (loongforge_\w+)\(([^\n]*)")


def test_every_hook_has_a_test():
    """Every hook is implemented by a plugin some test registers -- not merely named somewhere in tests/ -- and no
    test implements a hook that does not exist (a misspelt implementation would never be called)."""
    sources = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py")
    # test_plugins.py misspells one on purpose, to show the host refuses it
    implemented = {name for name, rest in _IMPLEMENTATION.findall(sources) if "on purpose" not in rest}
    hooks = {name for name, _ in hook_signatures()}
    assert not hooks - implemented, f"hooks no test plugin implements: {sorted(hooks - implemented)}"
    assert not implemented - hooks, f"test plugins implement hooks that do not exist: {sorted(implemented - hooks)}"
