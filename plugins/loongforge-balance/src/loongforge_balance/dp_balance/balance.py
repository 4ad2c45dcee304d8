"""One call per step: gather the global batch's sizes, plan with the cost model, move the samples.

Why it leaves the math alone: data parallelism sums the gradients of all ranks, so *which* rank computes a
sample does not matter as long as every sample is trained exactly once and the loss is normalised by a global
quantity (the global batch's token or sample count), not by each rank's own count. The trainer that calls this
must normalise that way; the all-reduced gradient then equals the unbalanced one up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongforge_balance.dp_balance.cost import CostModel
from loongforge_balance.dp_balance.exchange import Layout, exchange, gather_layout
from loongforge_balance.dp_balance.solver import Plan, evaluate, lpt_plan


@dataclass(frozen=True)
class Rebalanced:
    """The samples this rank now holds, with the predicted loads before and after."""

    samples: list[dict[str, torch.Tensor]]
    before: Plan
    after: Plan
    layout: Layout

    @property
    def moved(self) -> bool:
        return self.after is not self.before


def rebalance(
    samples: Sequence[Mapping[str, torch.Tensor]],
    cost: CostModel,
    group: dist.ProcessGroup | None = None,
    *,
    token_cap: int | None = None,
    length_key: str = "tokens",
) -> Rebalanced:
    """Redistribute the global batch across ``group`` to even out the predicted compute.

    Every rank must call this with its own samples. When the plan would not shorten the step (already balanced),
    nothing moves. Raises :class:`~loongforge_balance.dp_balance.solver.CapacityError` when the samples cannot
    be placed under ``token_cap``.
    """
    layout = gather_layout(samples, group, length_key)
    costs = cost.costs(layout.lengths)
    before = evaluate(layout.owners, costs, layout.lengths, layout.num_ranks)
    after = lpt_plan(costs, layout.lengths, layout.num_ranks, token_cap)
    if after.max_load >= before.max_load:
        return Rebalanced([dict(s) for s in samples], before, before, layout)
    return Rebalanced(exchange(samples, layout, after.ranks, group), before, after, layout)
