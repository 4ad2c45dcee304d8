"""Assign a global batch's samples to data-parallel ranks so that the slowest rank is as fast as possible.

The step time of synchronous data parallelism is the *maximum* over ranks of their compute, so the goal is to
minimise the largest predicted load (makespan scheduling). Longest-processing-time-first (LPT) — take samples
from the most to the least costly, give each to the currently least-loaded rank — is within 4/3 of optimal in
the worst case and within a fraction of a percent of the lower bound ``max(total / ranks, largest sample)`` on
realistic length mixes with several samples per rank (see ``benchmarks/dp_balance.py``).

Samples too costly to share a rank (a long video whose cost alone exceeds the ideal per-rank load) are
*scheduled*, not split: LPT places them first, each on its own rank, and the rest of the batch fills the other
ranks around them, so the step takes exactly as long as the largest sample — the lower bound. Splitting one
sample across DP ranks would change the math unless its parts never attend to each other; cutting a long
sequence that does attend across is context parallelism's job. (Packed rows of independent samples need no
splitting either: balance the samples before packing.)

The per-rank token cap bounds activation memory: a sample never goes to a rank whose tokens would exceed it.
The plan is a pure function of its inputs (ties broken by sample order and rank index), so every rank computes
the same plan from the same all-gathered lengths, without a coordinator.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: :func:`refine` stops this close to the lower bound (relative).
REFINE_TOLERANCE = 5e-3
#: :func:`refine` evens out this many (most loaded, least loaded) rank pairs per round ...
REFINE_PAIRS = 32
#: ... looking at this many of each rank's cheapest samples.
REFINE_SAMPLES = 64


class CapacityError(ValueError):
    """The samples do not fit the ranks under the token cap."""


@dataclass(frozen=True)
class Plan:
    """Destination rank of every sample and the predicted load and tokens of every rank."""

    ranks: np.ndarray  # int64 [samples]
    loads: np.ndarray  # float64 [num_ranks]
    tokens: np.ndarray  # int64 [num_ranks]
    lower_bound: float

    @property
    def max_load(self) -> float:
        return float(self.loads.max())

    @property
    def imbalance(self) -> float:
        """``max / mean`` load: 1.0 is perfect balance; the step takes ``imbalance`` times the ideal."""
        return self.max_load / float(self.loads.mean())

    @property
    def gap(self) -> float:
        """``max load / lower bound``: how far from the best any assignment could do (>= 1)."""
        return self.max_load / self.lower_bound


def lower_bound(costs: np.ndarray, num_ranks: int) -> float:
    """No assignment beats the average load or the largest single sample."""
    return max(float(costs.sum()) / num_ranks, float(costs.max()))


def evaluate(ranks: Sequence[int] | np.ndarray, costs: np.ndarray, lengths: np.ndarray, num_ranks: int) -> Plan:
    """The loads of a given assignment (e.g. the sampler's, to compare a plan against)."""
    ranks = np.asarray(ranks, dtype=np.int64)
    return Plan(
        ranks=ranks,
        loads=np.bincount(ranks, weights=costs, minlength=num_ranks).astype(np.float64),
        tokens=np.bincount(ranks, weights=lengths, minlength=num_ranks).astype(np.int64),
        lower_bound=lower_bound(costs, num_ranks),
    )


def lpt_plan(
    costs: Sequence[float] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    num_ranks: int,
    token_cap: int | None = None,
) -> Plan:
    """LPT assignment of samples (``costs``, ``lengths`` in tokens) to ``num_ranks`` ranks under ``token_cap``.

    Raises :class:`CapacityError` naming the sample when one is longer than the cap, or when the greedy finds
    no rank with room left for a sample.
    """
    costs = np.asarray(costs, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if num_ranks < 1 or costs.shape != lengths.shape or costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"need >= 1 rank and one cost per length, got {num_ranks} ranks, "
                         f"{costs.shape} costs, {lengths.shape} lengths")
    cap = int(lengths.sum()) if token_cap is None else int(token_cap)
    too_long = np.flatnonzero(lengths > cap)
    if too_long.size:
        i = int(too_long[0])
        raise CapacityError(f"sample {i} has {lengths[i]} tokens, more than the per-rank token cap {cap}: no rank "
                            "can hold it whole (raise token_cap or cut it with context parallelism)")
    order = np.argsort(-costs, kind="stable")
    ranks = np.empty(costs.size, dtype=np.int64)
    rank_tokens = [0] * num_ranks
    # (load, samples held, rank): the least-loaded rank first; among equals the emptier one, then the lower index.
    heap = [(0.0, 0, r) for r in range(num_ranks)]
    full: list[tuple[float, int, int]] = []
    for i, cost, length in zip(order.tolist(), costs[order].tolist(), lengths[order].tolist(), strict=True):
        while heap and rank_tokens[heap[0][2]] + length > cap:
            full.append(heapq.heappop(heap))
        if not heap:
            raise CapacityError(f"sample {i} ({length} tokens) fits on no rank: every rank is within {length} "
                                f"tokens of the token cap {cap} ({int(lengths.sum())} tokens over {num_ranks} ranks)")
        load, held, r = heap[0]
        heapq.heapreplace(heap, (load + cost, held + 1, r))
        ranks[i] = r
        rank_tokens[r] += length
        for entry in full:
            heapq.heappush(heap, entry)
        full.clear()
    return refine(evaluate(ranks, costs, lengths, num_ranks), costs, lengths, cap)


def refine(
    plan: Plan, costs: np.ndarray, lengths: np.ndarray, token_cap: int, *, tolerance: float = REFINE_TOLERANCE
) -> Plan:
    """Lower the largest loads by pairing the most loaded ranks with the least loaded ones and, in each pair,
    moving one sample across or swapping two, whichever evens the pair out best.

    LPT's last placements are of the cheapest samples, so what remains is a spread of about one small sample
    between ranks; one round fixes up to :data:`REFINE_PAIRS` over-loaded ranks at once. Each pair looks at the
    :data:`REFINE_SAMPLES` cheapest samples of both ranks, so a round costs the same for any batch size. Stops
    within ``tolerance`` of the lower bound, when a round improves nothing, or after one round per rank.
    """
    ranks, loads, tokens = plan.ranks.copy(), plan.loads.copy(), plan.tokens.copy()
    order = np.argsort(ranks, kind="stable")
    # Each rank's samples as a Python list sorted by cost: rounds change a few entries of short lists.
    members = [m[np.argsort(costs[m], kind="stable")].tolist() for m in
               np.split(order, np.cumsum(np.bincount(ranks, minlength=len(loads)))[:-1])]
    target = plan.lower_bound * (1 + tolerance)
    for _ in range(len(loads)):
        by_load = np.argsort(loads, kind="stable")
        tops = by_load[::-1][: min(REFINE_PAIRS, len(loads) // 2)]
        tops = tops[loads[tops] > target]
        improved = False
        for top, light in zip(tops.tolist(), by_load[: tops.size].tolist(), strict=True):
            improved |= _even_pair(top, light, members, ranks, loads, tokens, costs, lengths, token_cap)
        if not improved:
            break
    return Plan(ranks=ranks, loads=loads, tokens=tokens, lower_bound=plan.lower_bound)


def _even_pair(
    top: int, light: int, members: list[list[int]], ranks: np.ndarray, loads: np.ndarray, tokens: np.ndarray,
    costs: np.ndarray, lengths: np.ndarray, token_cap: int,
) -> bool:
    """The best single move or swap from ``top`` to ``light`` (in place); False if none lowers ``top``'s load."""
    mine = np.array(members[top][:REFINE_SAMPLES], dtype=np.int64)
    theirs = np.array(members[light][:REFINE_SAMPLES], dtype=np.int64)
    take_cost = np.append(costs[theirs], 0.0)[None, :]  # the last column: take nothing back (a move)
    take_len = np.append(lengths[theirs], 0)[None, :]
    give_cost, give_len = costs[mine][:, None], lengths[mine][:, None]
    delta = give_cost - take_cost
    fits = (tokens[top] - give_len + take_len <= token_cap) & (tokens[light] + give_len - take_len <= token_cap)
    result = np.where((delta > 0) & fits, np.maximum(loads[top] - delta, loads[light] + delta), np.inf)
    if result.size == 0 or not result.min() < loads[top]:
        return False
    a, b = np.unravel_index(int(np.argmin(result)), result.shape)
    moved_cost, moved_len = float(delta[a, b]), int(give_len[a, 0] - take_len[0, b])
    loads[top] -= moved_cost
    loads[light] += moved_cost
    tokens[top] -= moved_len
    tokens[light] += moved_len
    given = int(mine[a])
    ranks[given] = light
    _transfer(members, costs, given, top, light)
    if b < theirs.size:
        taken = int(theirs[b])
        ranks[taken] = top
        _transfer(members, costs, taken, light, top)
    return True


def _transfer(members: list[list[int]], costs: np.ndarray, sample: int, source: int, dest: int) -> None:
    """Move ``sample`` between two cost-sorted member lists, keeping both sorted."""
    members[source].remove(sample)
    bisect.insort(members[dest], sample, key=costs.item)
