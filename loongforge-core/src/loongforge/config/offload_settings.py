"""``training.offload_activations`` checked against the model and the rest of the run, without importing torch: the
pre-flight (``check``, ``train``) and the planner (``loongforge plan`` plans a cluster on a laptop) read it; the
mechanism is :mod:`loongforge.train.activation_offload`."""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError

__all__ = ["check_offload", "offloaded_layer_indices"]


def offloaded_layer_indices(options: Any, num_layers: int, source: str = "config") -> frozenset[int]:
    """The 0-based decoder layers ``training.offload_activations`` names, checked against the model's
    ``num_layers`` (a one-line :class:`ConfigError` naming the key otherwise)."""
    key = f"{source}: training.offload_activations.layers"
    if options.layers == "all":
        return frozenset(range(num_layers))
    if options.layers == "auto":
        raise ConfigError(f"{key} is auto: the planner chooses the layers, so it needs parallel: auto (or a config "
                          "written by loongforge plan --write)")
    bad = [index for index in options.layers if not 0 <= index < num_layers]
    if bad:
        raise ConfigError(f"{key} must be layer indices in [0, {num_layers - 1}] (the model has {num_layers} "
                          f"layers) or 'all', got {bad[0]}")
    if len(set(options.layers)) != len(options.layers) or not options.layers:
        raise ConfigError(f"{key} must name each layer once and at least one, got {options.layers}")
    return frozenset(options.layers)


def check_offload(config: Any, num_layers: int) -> str | None:
    """The pre-flight of ``training.offload_activations`` (``check`` and ``train``): its layers, and the settings it
    does not combine with; a one-line description for ``check``'s report, or None when offload is off."""
    options = config.training.offload_activations
    if options is None:
        return None
    where = f"{config.source}: training.offload_activations"
    if options.layers == "auto" and config.parallel.auto:
        return "activation offload: the planner chooses the layers (the first k of each stage, where memory needs it)"
    layers = offloaded_layer_indices(options, num_layers, config.source)
    if config.training.compile:
        raise ConfigError(f"{where} does not combine with training.compile (its hooks run Python for every saved "
                          "tensor, which compiled layers would have to guard on); turn one off")
    recompute = config.model.recompute
    if recompute is not None and recompute.granularity == "full":
        raise ConfigError(f"{where} does not combine with model.recompute granularity full (full recompute keeps "
                          "only each layer's input; its layers re-run inside backward); use selective recompute")
    return (f"activation offload: {len(layers)} of {num_layers} layer(s), saved storages of >= "
            f"{options.min_bytes} bytes to host memory")
