"""The catalog of first-party names (``loongforge/first_party_plugins.json``) that unknown-name errors use for their
``pip install`` hint stays in step with what the first-party plugins register, and names its distributions right."""

from __future__ import annotations

import pytest
from loongforge import builtin
from loongforge.plugins import PluginHost
from loongforge.registry import REGISTRY_KINDS, Registry, first_party_catalog, first_party_provider


@pytest.mark.needs_plugins
def test_every_name_a_catalogued_distribution_registers_maps_back_to_it():
    host = PluginHost()
    catalogued = {(kind, dist) for kind, _, dist in first_party_catalog()}
    registered = [(kind, entry.name, entry.provider)
                  for kind in REGISTRY_KINDS for entry in host.registry(kind).entries()]
    registered += [("command", command.name, command.provider) for command in host.commands().commands()]
    checked = [(kind, name, dist) for kind, name, dist in registered if (kind, dist) in catalogued]
    wrong = [(kind, name, dist, first_party_provider(kind, name)) for kind, name, dist in checked
             if first_party_provider(kind, name) != dist]
    assert not wrong, f"catalog out of step (kind, name, provider, catalog says): {wrong}"
    assert {dist for _, _, dist in checked} >= {"loongforge-vlm", "loongforge-diffusion", "loongforge-embodied",
                                                "loongforge-cuda", "loongforge-xpu"}


def test_names_of_core_are_never_attributed_to_a_plugin():
    host = PluginHost(autoload=False)
    host.register(builtin, "core", distribution="loongforge-core")
    for kind in REGISTRY_KINDS:
        for entry in host.registry(kind).entries():
            assert first_party_provider(kind, entry.name) is None, (kind, entry.name)


def test_missing_first_party_name_gives_the_install_line(monkeypatch):
    import loongforge.registry as registry_module

    monkeypatch.setattr(registry_module, "_is_installed", lambda dist: False)
    message = Registry("model").unknown_message("qwen2-vl-7b", where="model in run.yaml")
    assert message.endswith("'qwen2-vl-7b' is provided by loongforge-vlm, which is not installed: "
                            "pip install loongforge-vlm")
