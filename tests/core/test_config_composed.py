"""Composed models in a config: ``model: {encoder, projector, foundation}`` resolves through the plugin that
registered a model with ``with_parts``; parts on a plain decoder are a one-line error."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from loongforge import hookimpl
from loongforge.config.loader import load_config
from loongforge.config.resolve import decoder_flavor, resolve_model_flavor
from loongforge.errors import ConfigError, LoongForgeError


@dataclass(frozen=True)
class Composed:
    """A stand-in composed flavor: records the parts it was given, resolved through the model registry."""

    parts: dict = field(default_factory=dict)
    foundation: object = None

    def with_parts(self, parts, *, registry, where):
        resolved = {role: registry.load(value, where=f"model.{role} in {where}") if isinstance(value, str) else value
                    for role, value in parts.items()}
        return Composed(resolved, resolved.get("foundation", self.foundation))

    def compose(self, chunk, *, seed):
        return chunk


class ComposerPlugin:
    @hookimpl
    def loongforge_register_models(self, registry):
        registry.register("vlm", Composed(), description="test composer")


@pytest.fixture
def without_vlm_plugin(monkeypatch):
    """Core's seam on its own: the installed loongforge-vlm (which registers the real ``vlm``) is switched off
    before the test's plugin host discovers plugins."""
    monkeypatch.setenv("LOONGFORGE_DISABLE_PLUGINS", "vlm")


def _config(tmp_path, body: str):
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return load_config(path)


def test_parts_without_a_name_compose_and_resolve_through_the_registry(tmp_path, without_vlm_plugin, register_plugin):
    register_plugin(ComposerPlugin(), "composer")
    config = _config(tmp_path, "model: {encoder: {depth: 2}, foundation: qwen3-tiny}\n")
    assert config.model.name == "vlm"
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
