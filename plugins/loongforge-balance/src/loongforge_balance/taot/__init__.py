"""TAOT: topology-aware MoE expert replicas, planned every step (see ``planner`` for the why)."""

from loongforge_balance.taot.costs import PlanCosts, plan_costs
from loongforge_balance.taot.planner import ReplicaPlan, candidate_plans, node_of, pick_plan, plan_replicas

__all__ = ["PlanCosts", "ReplicaPlan", "candidate_plans", "node_of", "pick_plan", "plan_costs", "plan_replicas"]
