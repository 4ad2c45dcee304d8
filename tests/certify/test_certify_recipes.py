"""Certification recipes as a plugin contract: an outside plugin's recipe is registered through
``loongforge_register_certification_recipes`` and certified like core's; layouts are chosen per recipe; requests
certify cannot serve are one line before anything trains."""

from __future__ import annotations

import pytest
from loongforge import hookimpl
from loongforge.certify.device import CertifyError, certify_device
from loongforge.certify.recipes import DENSE_DECODER, MOE_DECODER, CertificationRecipe, Layout
from loongforge.plugins import get_host


class OutsideRecipe:
    """A third party's recipe: llama-debug on the shipped corpus, with a data-parallel layout."""

    @hookimpl
    def loongforge_register_certification_recipes(self, registry):
        registry.register("outside-llm", CertificationRecipe(
            description="llama-debug on shipped-corpus",
            config={"model": "llama-debug", "data": {"seq_length": 32},
                    "training": {"micro_batch_size": 2, "global_batch_size": 4, "sample_tokens": 0}},
            layouts={"dp2": Layout(2)}), description="an outside plugin's decoder")


def test_an_outside_plugins_recipe_is_listed_and_certified(register_plugin, tmp_path):
    register_plugin(OutsideRecipe(), "outside-recipe")
    registry = get_host().registry("certification_recipe")
    assert {"llm", "llm-moe", "outside-llm"} <= set(registry.names())
    lines = []
    certificate = certify_device("cpu", {"outside-llm": registry.load("outside-llm")}, tmp_path, steps=2,
                                 checks=("train", "resume"), progress=lines.append)
    assert certificate.passed and not certificate.complete
    assert [(c.recipe, c.name) for c in certificate.checks] == [("outside-llm", "train (1 process)"),
                                                                ("outside-llm", "resume on device")]
    assert any("outside-llm: training reference on cpu" in line for line in lines)


def test_layouts_are_each_recipes_own():
    assert DENSE_DECODER.chosen_layouts(None) == ("tp2", "pp2", "dp2")  # its defaults, not every layout it has
    assert MOE_DECODER.chosen_layouts(None) == ("ep2", "dp2", "tp2-sp")
    assert DENSE_DECODER.chosen_layouts(("ep2", "dp2")) == ("dp2",)  # a layout a recipe lacks is not run on it


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"steps": 1}, "--steps must be at least 2"),
    ({"checks": ("train", "speed")}, "unknown check(s) speed"),
    ({"checks": ()}, "no check selected"),
    ({"precision": "fp8"}, "precision 'fp8' is not certified"),
    ({"layouts": ("tp4",)}, "no recipe has layout(s) tp4"),
])
def test_what_certify_cannot_serve_is_one_line_before_training(kwargs, message, tmp_path):
    with pytest.raises(CertifyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        certify_device("cpu", {"llm": DENSE_DECODER}, tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written
