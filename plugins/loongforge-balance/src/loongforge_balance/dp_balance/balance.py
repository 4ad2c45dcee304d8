"""One call per step: gather the global batch's sizes, plan with the cost model, move the samples.

Why it leaves the math alone: data parallelism sums the gradients of all ranks, so *which* rank computes a
sample does not matter as long as every sample is trained exactly once and the loss is normalised by a global
quantity (the global batch's token or sample count), not by each rank's own count. The trainer that calls this
must normalise that way; the all-reduced gradient then equals the unbalanced one up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
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
    #: The plan was better but some rank could not hold its new samples (``fits``): nothing moved.
    unfit: bool = False

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
    fits: Callable[[np.ndarray], bool] | None = None,
) -> Rebalanced:
    """Redistribute the global batch across ``group`` to even out the predicted compute.

    Every rank must call this with its own samples. When the plan would not shorten the step (already balanced),
    nothing moves. Raises :class:`~loongforge_balance.dp_balance.solver.CapacityError` when the samples cannot
    be placed under ``token_cap``. ``fits(lengths)`` says whether a rank can hold samples of these lengths (a data
    path with fixed rows: the token cap bounds the tokens, but rows fragment); it is asked, for every rank whose
    samples would change, on every rank alike, and when any says no the sampler's placement is kept.
    """
    layout = gather_layout(samples, group, length_key)
    costs = cost.costs(layout.lengths, layout.encoder)
    before = evaluate(layout.owners, costs, layout.lengths, layout.num_ranks)
    after = lpt_plan(costs, layout.lengths, layout.num_ranks, token_cap)
    if after.max_load >= before.max_load:
        return Rebalanced([dict(s) for s in samples], before, before, layout)
    if fits is not None and not _all_fit(layout, after.ranks, fits):
        return Rebalanced([dict(s) for s in samples], before, before, layout, unfit=True)
    return Rebalanced(exchange(samples, layout, after.ranks, group), before, after, layout)


def _all_fit(layout: Layout, destinations: np.ndarray, fits: Callable[[np.ndarray], bool]) -> bool:
    """Whether every rank whose samples change can hold its planned ones (a pure function of the gathered sizes,
    so every rank reaches the same answer without a collective)."""
    owners = layout.owners
    for rank in range(layout.num_ranks):
        planned = np.flatnonzero(destinations == rank)
        if not np.array_equal(planned, np.flatnonzero(owners == rank)) and not fits(layout.lengths[planned]):
            return False
    return True
