"""The example family passes LoongForge's model-family conformance suite -- the test every family author copies."""

from __future__ import annotations

from loongforge.testing.family_suite import ModelFamilySuite
from loongforge_example_family.flavors import FLAVORS


class TestExampleGPTTiny(ModelFamilySuite):
    family = FLAVORS["example-gpt-tiny"]
    has_hf_adapter = True


def test_discovered_with_version():
    import loongforge_example_family
    from loongforge.testing.discovery import assert_discovered

    assert_discovered("example-family", "loongforge-example-family", loongforge_example_family.__version__)
