"""What a plan costs: rank imbalance, weight bytes over inter-node links, token copies across nodes.

Shared by the tests (acceptance numbers) and ``benchmarks/taot_placement.py`` so that both measure the same
thing. A clone's weights travel every step (training updates them), so clone bytes are a per-step cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_balance.taot.planner import ReplicaPlan, node_of


@dataclass(frozen=True)
class PlanCosts:
    max_over_mean: float  # the busiest rank's tokens over the mean
    inter_node_clones: int  # clones whose home rank is on another node
    cross_node_tokens: int  # (token, expert) copies sent from a source rank to a rank on another node

    def inter_node_bytes(self, expert_bytes: int) -> int:
        return self.inter_node_clones * expert_bytes


def plan_costs(plan: ReplicaPlan, ranks_per_node: int) -> PlanCosts:
    """Measure ``plan`` on the real topology (``ranks_per_node`` consecutive ranks share a node)."""
    ranks = plan.num_ranks
    nodes = node_of(ranks, ranks_per_node, plan.home_keep.device)
    load = plan.rank_load().to(torch.float64)
    used = plan.slot_expert >= 0
    clone_rank = torch.arange(ranks * plan.spare_slots, device=nodes.device) // max(plan.spare_slots, 1)
    home_rank = plan.slot_expert.clamp(min=0) // plan.experts_per_rank
    inter_clones = used & (nodes[clone_rank] != nodes[home_rank])
    crossing = (nodes.view(-1, 1) != nodes.view(1, -1)).to(torch.int64)  # [source, destination]
    tokens_to_rank = plan.flow().sum(dim=2)  # [source, destination]
    return PlanCosts(
        max_over_mean=(load.max() / load.mean()).item(),
        inter_node_clones=int(inter_clones.sum().item()),
        cross_node_tokens=int((tokens_to_rank * crossing).sum().item()),
    )
