"""The ``taot`` optimization: every megatron MoE layer of the model plans and uses expert replicas each step::

    parallel: {ep: 16}
    optimizations:
      taot: {spare_slots: 1, topology_weight: 0.25, ranks_per_node: 8}

``ranks_per_node`` counts expert-parallel ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``, else 8).
A model it cannot apply to (no MoE layer, grouped-GEMM or tensor-parallel experts, ...) fails at enable time
with the reason; it never trains without replicas while claiming to use them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from loongforge import hookimpl
from loongforge.errors import ConfigError, LoongForgeError

from loongforge_balance.taot.layer import ReplicaSettings

NAME = "taot"
OPTIONS = ("spare_slots", "topology_weight", "ranks_per_node")


def settings_from_options(options: Mapping[str, Any]) -> ReplicaSettings:
    """Validated :class:`ReplicaSettings` from the config's ``optimizations.taot`` mapping."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"optimizations.{NAME}: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    defaults = ReplicaSettings(ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    values = {name: options.get(name, getattr(defaults, name)) for name in OPTIONS}
    for name in ("spare_slots", "ranks_per_node"):
        if isinstance(values[name], bool) or not isinstance(values[name], int):
            raise ConfigError(f"optimizations.{NAME}.{name} must be an integer, got {values[name]!r}")
    if values["spare_slots"] < 1:
        raise ConfigError(f"optimizations.{NAME}.spare_slots must be >= 1 (spare expert slots per rank), "
                          f"got {values['spare_slots']}")
    if values["ranks_per_node"] < 1:
        raise ConfigError(f"optimizations.{NAME}.ranks_per_node must be >= 1, got {values['ranks_per_node']}")
    weight = values["topology_weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ConfigError(f"optimizations.{NAME}.topology_weight must be a number >= 0, got {weight!r}")
    return ReplicaSettings(spare_slots=values["spare_slots"], topology_weight=float(weight),
                           ranks_per_node=values["ranks_per_node"])


class TAOTOptimization:
    """Created from ``optimizations: {taot: {spare_slots, topology_weight, ranks_per_node}}``."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.settings = settings_from_options(options)
        self.layers: list[Any] = []

    @hookimpl
    def loongforge_modify_model(self, model: Any, config: Any) -> None:
        """Switch every megatron ``MoELayer`` of the model chunks to the replicated forward, in place."""
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from loongforge_balance.taot.megatron import enable_replicas, why_not_replicable

        named = [(name, module) for chunk in model for name, module in chunk.named_modules()
                 if isinstance(module, MoELayer)]
        if not named:
            raise LoongForgeError(f"{NAME} places mixture-of-experts replicas, but the model has no megatron MoE "
                                  "layer; use an MoE flavor (e.g. mixtral-tiny, qwen3-moe-tiny) or remove it")
        for name, layer in named:
            reason = why_not_replicable(layer)
            if reason:
                raise LoongForgeError(f"{NAME} cannot replicate the experts of {name}: {reason}")
        for _, layer in named:
            enable_replicas(layer, self.settings)
        self.layers = [layer for _, layer in named]
