"""Data-parallel load balancing: predict each sample's compute, plan an even split, move the samples."""

from loongforge_balance.dp_balance.balance import Rebalanced, rebalance
from loongforge_balance.dp_balance.cost import CostModel, load_features
from loongforge_balance.dp_balance.exchange import Layout, exchange, gather_layout
from loongforge_balance.dp_balance.fit import fit_cost_model, fit_from_steps
from loongforge_balance.dp_balance.solver import CapacityError, Plan, evaluate, lower_bound, lpt_plan

__all__ = [
    "CapacityError",
    "CostModel",
    "Layout",
    "Plan",
    "Rebalanced",
    "evaluate",
    "exchange",
    "fit_cost_model",
    "fit_from_steps",
    "gather_layout",
    "load_features",
    "lower_bound",
    "lpt_plan",
    "rebalance",
]
