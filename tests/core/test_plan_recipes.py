"""``loongforge plan`` answers for every shipped recipe: a ranked layout for megatron-engine models (LLMs, VLMs) and
for task-engine models whose family states its sizes (the Wan DiTs), a one-line refusal (exit 2, no traceback) for
the task models that state none."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.resolve import resolve_model_flavor

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
pytestmark = pytest.mark.needs_plugins  # the recipes name the first-party plugins' models


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_plan_answers_every_recipe(path, capsys):
    family = resolve_model_flavor(load_config(path))
    code = main(["plan", str(path), "--devices", "8", "--device-memory", "80GiB"])
    out, err = capsys.readouterr()
    if family.engine == "megatron":
        assert code == 0, err
        assert "chose tp" in out and "Traceback" not in err
    elif family.task_terms(load_config(path)) is not None:
        assert code == 0, err
        assert "chose " in out and " dp" in out and "Traceback" not in err
    else:
        assert code == 2 and out == ""
        assert err.strip().splitlines() == [
            f"error: {path}: model '{load_config(path).model.name}' is trained by the task engine and states no "
            "sizes for the planner (ModelFamily.task_terms)"]


def test_recipes_cover_both_engines():
    engines = {resolve_model_flavor(load_config(path)).engine for path in CONFIGS}
    assert engines == {"megatron", "task"}
