"""Entry point of the ``balance`` plugin: registers its optimizations by import path.

Torch-free at import: an optimization's module is loaded only when a config switches it on.
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_optimizations(registry):
    registry.register(
        "taot",
        "loongforge_balance.taot.optimization:TAOTOptimization",
        description="topology-aware MoE expert replicas: hot experts cloned into spare slots every step",
    )
    registry.register(
        "dp-balance",
        "loongforge_balance.dp_balance.optimization:DPBalanceOptimization",
        description="data-parallel load balancing: samples redistributed across DP ranks by predicted cost",
    )
