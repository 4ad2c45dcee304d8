"""Registries: lazy targets, aliases, duplicate detection and the unknown-name message."""

from __future__ import annotations

import pytest
from loongforge.registry import DuplicateComponentError, Registry, UnknownComponentError


def make_registry():
    registry = Registry("model")
    registry.current_provider = "pkg-a"
    registry.register("llama3-8b", object(), aliases=("meta-llama/Meta-Llama-3-8B",))
    registry.register("qwen3-0.6b", "json:dumps", description="lazy")
    return registry


def test_alias_and_case_insensitive_lookup():
    registry = make_registry()
    assert registry.entry("Meta-Llama/Meta-Llama-3-8B").name == "llama3-8b"
    assert "QWEN3-0.6B" in registry


def test_lazy_target_is_imported_on_load():
    import json

    assert make_registry().load("qwen3-0.6b") is json.dumps


def test_import_path_escape_hatch():
    import os

    assert make_registry().load("os.path:join") is os.path.join


def test_duplicate_names_both_providers():
    registry = make_registry()
    registry.current_provider = "pkg-b"
    with pytest.raises(DuplicateComponentError, match="by pkg-a and by pkg-b"):
        registry.register("other", 1, aliases=("llama3-8b",))


def test_unknown_name_lists_known_and_suggests():
    with pytest.raises(UnknownComponentError) as err:
        make_registry().entry("qwen3-06b", where="model in run.yaml")
    message = str(err.value)
    assert message.startswith("Unknown model 'qwen3-06b' (model in run.yaml).")
    assert "Known: llama3-8b, qwen3-0.6b." in message
    assert "Did you mean 'qwen3-0.6b'?" in message


def test_unknown_name_of_uninstalled_first_party_plugin(monkeypatch):
    import loongforge.registry as registry_module

    monkeypatch.setattr(registry_module, "_is_installed", lambda dist: dist != "loongforge-diffusion")
    message = make_registry().unknown_message("wan2.1-t2v-1.3b")
    assert "provided by loongforge-diffusion, which is not installed: pip install loongforge-diffusion" in message
    assert "not installed" not in make_registry().unknown_message("qwen2-vl-2b")  # vlm counts as installed
