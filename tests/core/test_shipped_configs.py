"""Every shipped recipe loads, and every name in it resolves to an installed component."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.config import load_config
from loongforge.resolve import resolve_names

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
#: Recipes whose every component core registers; the others name the first-party plugins' models.
CORE_RECIPES = ("quickstart.yaml", "sft-tiny.yaml")


def test_there_are_recipes():
    assert CONFIGS


@pytest.mark.parametrize("path", [p if p.name in CORE_RECIPES else pytest.param(p, marks=pytest.mark.needs_plugins)
                                  for p in CONFIGS], ids=lambda p: p.name)
def test_recipe_loads_and_resolves(path):
    config = load_config(path)
    lines = resolve_names(config)
    assert any(line.startswith("model: ") for line in lines)
