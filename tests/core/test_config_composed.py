"""Composed models in a config: ``model: {encoder, projector, foundation}`` resolves through the plugin that
registered a model with ``with_parts``; parts on a plain decoder are a one-line error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from loongforge import hookimpl
from loongforge.config.loader import load_config
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.models.family import ModelFamily
from loongforge.plugins import get_host
from loongforge.resolve import decoder_flavor, resolve_model_flavor


@dataclass(frozen=True)
class Composed(ModelFamily):
    """A stand-in composed family: records the parts it was given, resolved through the model registry."""

    part_roles: ClassVar[tuple[str, ...]] = ("encoder", "projector", "foundation")
    default_composition: ClassVar[bool] = True
    parts: dict = field(default_factory=dict)
    foundation: object = None

    def with_parts(self, parts, *, registry, where):
        resolved = {role: registry.load(value, where=f"model.{role} in {where}") if isinstance(value, str) else value
                    for role, value in parts.items()}
        return Composed(resolved, resolved.get("foundation", self.foundation))

    @property
    def decoder(self):
        return self.foundation


class ComposerPlugin:
    @hookimpl
    def loongforge_register_models(self, registry):
        registry.register("vlm", Composed(), description="test composer")


@pytest.fixture
def without_vlm_plugin(monkeypatch):
    """Core's seam on its own: the installed loongforge-vlm (which registers the real ``vlm``) is switched off
    before the test's plugin host discovers plugins. The process-wide host is made first, so the one the
    ``plugin_host`` fixture restores afterwards still has every plugin."""
    get_host()
    monkeypatch.setenv("LOONGFORGE_DISABLE_PLUGINS", "vlm")


def _config(tmp_path, body: str):
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return load_config(path)


def test_parts_without_a_name_compose_and_resolve_through_the_registry(tmp_path, without_vlm_plugin, register_plugin):
    register_plugin(ComposerPlugin(), "composer")
    config = _config(tmp_path, "model: {encoder: {depth: 2}, foundation: qwen3-tiny}\n")
    assert config.model.name is None  # parts alone name no model: the family with default_composition composes
    assert config.model.parts == {"encoder": {"depth": 2}, "foundation": "qwen3-tiny"}
    flavor = resolve_model_flavor(config)
    assert flavor.parts["encoder"] == {"depth": 2}
    assert decoder_flavor(flavor).num_layers == flavor.parts["foundation"].num_layers  # the registered qwen3-tiny


def test_parts_on_a_plain_decoder_and_unknown_parts_are_one_line_errors(tmp_path, without_vlm_plugin, register_plugin):
    register_plugin(ComposerPlugin(), "composer")
    config = _config(tmp_path, "model: {name: llama-tiny, foundation: qwen3-tiny}\n")
    with pytest.raises(ConfigError, match=r"run.yaml: model.foundation set, but model 'llama-tiny' is not composed"):
        resolve_model_flavor(config)
    config = _config(tmp_path, "model: {foundation: no-such-llm}\n")
    with pytest.raises(LoongForgeError, match=r"model.foundation in .*run.yaml") as error:
        resolve_model_flavor(config)
    assert "\n" not in str(error.value)


def test_part_roles_are_checked_against_the_family_with_a_did_you_mean(tmp_path, without_vlm_plugin,
                                                                        register_plugin):
    register_plugin(ComposerPlugin(), "composer")
    config = _config(tmp_path, "model: {name: vlm, encodr: {depth: 2}, foundation: qwen3-tiny}\n")
    with pytest.raises(ConfigError, match=r"run.yaml: model.encodr: model 'vlm' has no part 'encodr'; its parts: "
                                          r"encoder, projector, foundation. Did you mean 'encoder'\?"):
        resolve_model_flavor(config)
    config = _config(tmp_path, "model: vlm\n")  # a bare composition without its parts cannot be built
    with pytest.raises(ConfigError, match=r"model 'vlm' is composed from parts; set model.encoder/projector/"):
        resolve_model_flavor(config)


def test_parts_without_a_name_need_exactly_one_default_composition(tmp_path, without_vlm_plugin, register_plugin):
    config = _config(tmp_path, "model: {foundation: qwen3-tiny}\n")
    with pytest.raises(ConfigError, match=r"model.foundation set without model.name, and no installed model family "
                                          r"composes a model from these parts"):
        resolve_model_flavor(config)

    class Two:
        @hookimpl
        def loongforge_register_models(self, registry):
            registry.register("composer-a", Composed())
            registry.register("composer-b", Composed())

    register_plugin(Two(), "two")
    with pytest.raises(ConfigError, match=r"several families compose such a model \(composer-a, composer-b\)"):
        resolve_model_flavor(config)


def make_tiny_llama():
    """A ``pkg.module:factory`` target: returns a family."""
    from loongforge.models.registration import all_flavors

    return all_flavors()["llama-debug"]


def not_a_family():
    return {"num_layers": 2}


def test_import_path_must_give_a_model_family(tmp_path):
    config = _config(tmp_path, f"model: {{name: '{__name__}:make_tiny_llama'}}\n")
    assert resolve_model_flavor(config).family_name == "llama"
    config = _config(tmp_path, f"model: {{name: '{__name__}:not_a_family'}}\n")
    with pytest.raises(ConfigError, match=r"resolved to dict, which is not a loongforge.models.family.ModelFamily"):
        resolve_model_flavor(config)
