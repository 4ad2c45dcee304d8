"""LoongForge: one training framework for LLMs, VLMs, diffusion and embodied models.

This module is the public API. Importing it is cheap (no torch, no megatron): the plugin listing and
config checks answer instantly, and torch is imported only when a run is built.
"""

from __future__ import annotations

from loongforge import megatron_import
from loongforge.config import LoongForgeConfig, load_config
from loongforge.errors import ConfigError, LoongForgeError, PluginLoadError
from loongforge.plugins import PluginHost, get_host, get_registry, hookimpl
from loongforge.registry import Registry, UnknownComponentError

__version__ = "0.5.0"

megatron_import.install()  # before any LoongForge module imports megatron-core: see loongforge.megatron_import


def train(config: LoongForgeConfig | str, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Run training from a config object or a YAML path; returns the summary metrics."""
    from loongforge.train.run import run_training

    if not isinstance(config, LoongForgeConfig):
        config = load_config(config, overrides)
    return run_training(config)


__all__ = [
    "ConfigError",
    "LoongForgeConfig",
    "LoongForgeError",
    "PluginHost",
    "PluginLoadError",
    "Registry",
    "UnknownComponentError",
    "__version__",
    "get_host",
    "get_registry",
    "hookimpl",
    "load_config",
    "train",
]
