"""Independent references for TAOT placement: the fewest inter-node clones any balanced plan can have.

Plain Python and scipy only, never the plugin's code, so the TAOT tests and ``benchmarks/taot_placement.py``
measure the planner against something it did not compute. Both work on per-expert loads (the sum over source
ranks): which source a clone's tokens come from changes no rank's load.

- ``per_node_lower_bound``: a node's excess over its ranks' capacity leaves on clones hosted on other nodes, each
  carrying at most one rank's capacity and an expert's clones together at most its load; counting the biggest
  such pieces that cover the excess bounds every plan from below.
- ``milp_fewest_inter_node_clones``: the placement itself as a MILP (HiGHS via scipy), with the per-node bound as
  a cut so that the solver's bound starts there. ``full_nodes_export_only`` restricts inter-node clones to experts
  of nodes above capacity placed on nodes below it: the model shrinks several-fold (64 ranks solve in seconds to
  a minute instead of not at all), its optimum can only be higher, and every solution it returns is still a valid
  balanced placement. ``node_limit`` (deterministic, unlike a time limit) caps the branch and bound; the result
  then is the incumbent (a placement) and the solver's bound.
"""

from __future__ import annotations

from dataclasses import dataclass

BALANCE_BOUND = 1.06  # max/mean rank load every plan must meet


def per_node_lower_bound(expert_load: list[float], ranks_per_node: int, experts_per_rank: int) -> int:
    """Fewest inter-node clones any plan with every rank at <= BALANCE_BOUND x mean needs (module docstring)."""
    cap = BALANCE_BOUND * sum(expert_load) / (len(expert_load) // experts_per_rank)
    per_node = ranks_per_node * experts_per_rank
    return sum(_node_pieces(expert_load[first:first + per_node], ranks_per_node, cap)
               for first in range(0, len(expert_load), per_node))


def _node_pieces(node_loads: list[float], ranks_per_node: int, cap: float) -> int:
    excess = sum(node_loads) - ranks_per_node * cap
    pieces = sorted((piece for load in node_loads for piece in [cap] * int(load // cap) + [load % cap]), reverse=True)
    needed = 0
    for piece in pieces:  # the node's biggest pieces, until they cover its excess
        if excess <= 1e-9:
            break
        excess -= piece
        needed += 1
    return needed


@dataclass(frozen=True)
class MilpResult:
    clones: int | None  # inter-node clones of the best placement found (None: none found within the node limit)
    bound: int  # no placement of this model has fewer
    optimal: bool


def milp_fewest_inter_node_clones(expert_load: list[float], ranks_per_node: int, experts_per_rank: int,
                                  spare_slots: int, *, full_nodes_export_only: bool = False,
                                  node_limit: int | None = None) -> MilpResult:
    """Fewest inter-node clones with every rank at <= BALANCE_BOUND x mean, solved by HiGHS.

    Variables per allowed (rank r, expert e not homed on r): ``x`` binary (a clone of e in a slot of r) and
    ``y`` >= 0 (tokens of e computed there). Slots: sum_e x[r, e] <= spare_slots; y <= x * min(load_e, cap); an
    expert gives away at most its load; rank load = home experts' load - given away + taken in <= cap; per node,
    inter-node clones of its experts >= the per-node bound (a valid cut).
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    loads = [float(x) for x in expert_load]
    experts, ranks = len(loads), len(loads) // experts_per_rank
    nodes, per_node = ranks // ranks_per_node, ranks_per_node * experts_per_rank
    cap = BALANCE_BOUND * sum(loads) / ranks
    home = [e // experts_per_rank for e in range(experts)]
    node_excess = [sum(loads[n * per_node:(n + 1) * per_node]) - ranks_per_node * cap for n in range(nodes)]

    def allowed(rank: int, expert: int) -> bool:
        source, target = home[expert] // ranks_per_node, rank // ranks_per_node
        if rank == home[expert]:
            return False
        return (not full_nodes_export_only or source == target
                or (node_excess[source] > 0 and node_excess[target] < 0))

    pairs = [(r, e) for r in range(ranks) for e in range(experts) if allowed(r, e)]
    n = len(pairs)
    entries: list[tuple[int, int, float]] = []  # (row, column, value)
    low: list[float] = []
    high: list[float] = []
    slot_row, give_row, load_row, cut_row = n, n + ranks, n + ranks + experts, n + 2 * ranks + experts
    for i, (r, e) in enumerate(pairs):
        entries += [(i, i, -min(loads[e], cap)), (i, n + i, 1.0), (slot_row + r, i, 1.0), (give_row + e, n + i, 1.0),
                    (load_row + r, n + i, 1.0), (load_row + home[e], n + i, -1.0)]
        if r // ranks_per_node != home[e] // ranks_per_node:
            entries.append((cut_row + home[e] // ranks_per_node, i, 1.0))
    low += [-np.inf] * n + [0.0] * (ranks + experts) + [-np.inf] * ranks
    high += [0.0] * n + [float(spare_slots)] * ranks + loads
    high += [cap - sum(loads[r * experts_per_rank:(r + 1) * experts_per_rank]) for r in range(ranks)]
    low += [float(_node_pieces(loads[k * per_node:(k + 1) * per_node], ranks_per_node, cap)) for k in range(nodes)]
    high += [np.inf] * nodes
    rows, cols, values = zip(*entries, strict=True)
    matrix = coo_matrix((values, (rows, cols)), shape=(cut_row + nodes, 2 * n)).tocsr()
    cost = [float(r // ranks_per_node != home[e] // ranks_per_node) for r, e in pairs] + [0.0] * n
    options = {} if node_limit is None else {"node_limit": node_limit}
    result = milp(cost, constraints=LinearConstraint(matrix, low, high), integrality=[1] * n + [0] * n,
                  bounds=Bounds([0.0] * (2 * n), [1.0] * n + [np.inf] * n), options=options)
    if result.status not in (0, 1):  # 0: optimal, 1: a limit was reached
        raise RuntimeError(f"taot reference MILP: {result.message}")
    clones = None if result.x is None else round(result.fun)
    bound = int(np.ceil(result.mip_dual_bound - 1e-6))
    return MilpResult(clones, bound, result.status == 0)
