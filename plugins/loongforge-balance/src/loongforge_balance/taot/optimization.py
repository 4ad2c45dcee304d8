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
from dataclasses import dataclass
from typing import Any

from loongforge import hookimpl
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.optimizations import Optimization

from loongforge_balance.taot.layer import ReplicaSettings

NAME = "taot"


@dataclass(frozen=True)
class TAOTOptions:
    """``optimizations.taot``: spare expert slots per rank, topology weight, expert-parallel ranks per node."""

    spare_slots: int = 1
    topology_weight: float = 0.5
    #: null: torchrun's ``LOCAL_WORLD_SIZE``, else 8.
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.spare_slots < 1:
            raise ConfigError(f"spare_slots must be >= 1 (spare expert slots per rank), got {self.spare_slots}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not 0 <= self.topology_weight <= 1:
            raise ConfigError(f"topology_weight must be a number in [0, 1], got {self.topology_weight}")


class TAOTOptimization(Optimization):
    """Created from ``optimizations: {taot: {spare_slots, topology_weight, ranks_per_node}}``."""

    name = NAME
    options_type = TAOTOptions

    def __init__(self, options: Mapping[str, Any] | None = None, *, source: str = "config") -> None:
        super().__init__(options, source=source)
        opts: TAOTOptions = self.options
        ranks = opts.ranks_per_node if opts.ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", 8))
        self.settings = ReplicaSettings(spare_slots=opts.spare_slots, topology_weight=opts.topology_weight,
                                        ranks_per_node=ranks)
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
