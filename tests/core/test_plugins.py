"""Plugin discovery, allow/block lists, broken plugins and in-process registration."""

from __future__ import annotations

from pathlib import Path

import loongforge.plugins as plugins_module
import pytest
import tomllib
from importlib_metadata import EntryPoint
from loongforge import hookimpl
from loongforge.errors import PluginLoadError
from loongforge.plugins import PluginHost

FIRST_PARTY = {"core", "cuda", "xpu", "vlm", "diffusion", "embodied"}
ROOT = Path(__file__).resolve().parents[2]


def _declared_version(project: str) -> str:
    return tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.needs_plugins
def test_core_and_first_party_plugins_are_discovered():
    host = PluginHost()
    assert FIRST_PARTY <= set(host.plugins)
    assert host.plugins["vlm"].distribution == "loongforge-vlm"
    # the installed distributions' versions, as their pyproject.toml declares them
    assert host.plugins["core"].version == _declared_version("loongforge-core")
    assert host.plugins["vlm"].version == _declared_version("plugins/loongforge-vlm")


def test_core_registers_through_its_own_hooks():
    host = PluginHost()
    assert "cpu" in host.registry("device")
    assert host.registry("device").entry("cpu").provider == "loongforge-core"
    assert "llama-tiny" in host.registry("model")
    assert host.plugins["core"].registered["model"]


@pytest.mark.needs_plugins
def test_block_list_hides_plugin(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_DISABLE_PLUGINS", "vlm, diffusion")
    host = PluginHost()
    assert "vlm" not in host.plugins and "diffusion" not in host.plugins and "embodied" in host.plugins


@pytest.mark.needs_plugins
def test_allow_list_keeps_core(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_LOAD_PLUGINS", "embodied")
    assert set(PluginHost().plugins) == {"core", "embodied"}


def test_plugin_that_fails_to_import_is_named(monkeypatch):
    broken = EntryPoint(name="acme", value="acme_no_such_module_xyz.plugin", group="loongforge")
    monkeypatch.setattr(plugins_module, "entry_points", lambda group: [broken])
    with pytest.raises(PluginLoadError) as err:
        PluginHost()
    message = str(err.value)
    assert "plugin 'acme'" in message and "LOONGFORGE_DISABLE_PLUGINS=acme" in message


def test_misspelled_hook_is_caught():
    class Typo:
        @hookimpl
        def loongforge_register_modles(self, registry):  # misspelled on purpose
            registry.register("x", 1)

    host = PluginHost(autoload=False)
    with pytest.raises(PluginLoadError, match=r"plugin 'typo'.*loongforge_register_modles"):
        host.register(Typo(), "typo")
    assert "typo" not in host.plugins


def test_failing_registration_names_plugin():
    class Crashes:
        @hookimpl
        def loongforge_register_models(self, registry):
            raise RuntimeError("boom")

    host = PluginHost(autoload=False)
    host.register(Crashes(), "crashes")
    with pytest.raises(PluginLoadError, match=r"plugin 'crashes'.*loongforge_register_models: boom"):
        host.registry("model")


def test_in_process_plugin_fixture_registers_and_cleans_up(register_plugin, plugin_host):
    class Extra:
        @hookimpl
        def loongforge_register_datasets(self, registry):
            registry.register("my-data", "json:loads", description="third-party data")

    register_plugin(Extra(), "extra")
    entry = plugin_host.registry("dataset").entry("my-data")
    assert entry.provider == "<in-process>" and plugin_host.plugins["extra"].registered == {"dataset": ["my-data"]}


def test_duplicate_registration_names_both_plugins():
    class Dup:
        @hookimpl
        def loongforge_register_devices(self, registry):
            registry.register("cpu", object)

    host = PluginHost()
    host.register(Dup(), "dup")
    with pytest.raises(PluginLoadError, match="registered twice: by loongforge-core and by <in-process>"):
        host.registry("device")


def test_modify_model_chains_replacements():
    class Wrap:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        def loongforge_modify_model(self, model):
            return [*model, self.tag]

    host = PluginHost(autoload=False)
    host.register(Wrap("a"), "a")
    host.register(Wrap("b"), "b")
    assert host.modify_model(["m"], config=None) == ["m", "a", "b"]
