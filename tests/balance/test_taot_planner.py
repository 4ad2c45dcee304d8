"""The TAOT replica planner: invariants, determinism, no host reads, and the balance/topology numbers.

Loads come from ``skewed_counts`` (fixed seeds, 128 experts, 4096 tokens x top-8 per rank, 8 ranks per node),
so the numbers below are reproducible; the no-replication baseline is checked to be far from balanced, so
the balance bounds say something.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from loongforge_balance.taot import candidate_plans, pick_plan, plan_costs, plan_replicas
from loongforge_balance.taot.synthetic import skewed_counts
from torch.utils._python_dispatch import TorchDispatchMode

# The independent references (plain Python + scipy, not the plugin's code) live with the benchmark that prints them.
_REFERENCE_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "taot_reference.py"
_spec = importlib.util.spec_from_file_location("taot_reference", _REFERENCE_PATH)
reference = sys.modules.setdefault("taot_reference", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(reference)

EXPERTS, RANKS_PER_NODE, TOPOLOGY_WEIGHT = 128, 8, 0.5


def plan(counts, spare_slots, *, blind=False, **kw):
    ranks = counts.shape[0]
    return plan_replicas(counts, experts_per_rank=counts.shape[1] // ranks, spare_slots=spare_slots,
                         ranks_per_node=ranks if blind else RANKS_PER_NODE,
                         topology_weight=0.0 if blind else kw.get("topology_weight", TOPOLOGY_WEIGHT))


@pytest.fixture(scope="module")
def loads():
    """Four steps of 64 ranks from each of three seeds; smaller worlds use the first ranks."""
    return torch.cat([skewed_counts(4, 64, EXPERTS, seed=seed) for seed in range(3)])


def check_invariants(counts, p, spare_slots):
    ranks, experts = counts.shape
    local = experts // ranks
    assert p.slot_expert.shape == (ranks * spare_slots,)  # at most K clones per rank: K slots each
    used = p.slot_expert >= 0
    slot_rank = torch.arange(ranks * spare_slots) // spare_slots
    assert not (used & (p.slot_expert // local == slot_rank)).any()  # never on the expert's home rank
    for rank in range(ranks):  # one clone of an expert per rank at most
        held = p.slot_expert[slot_rank == rank]
        held = held[held >= 0]
        assert held.unique().numel() == held.numel()
    assert (p.slot_take[~used] == 0).all()  # empty slots get nothing
    assert (p.slot_take[used].sum(dim=1) > 0).all()  # a clone is only made to take tokens
    assert (p.home_keep >= 0).all() and (p.slot_take >= 0).all()
    # Tokens conserved per (source, expert): a clone only receives tokens of the expert it holds.
    placed = p.home_keep.clone()
    placed.index_add_(1, p.slot_expert[used], p.slot_take[used].t())
    assert torch.equal(placed, counts)
    assert p.rank_load().sum() == counts.sum()


@pytest.mark.parametrize("ranks,spare_slots", [(16, 1), (32, 2), (64, 2)])
def test_invariants_and_determinism(loads, ranks, spare_slots):
    counts = loads[0, :ranks]
    first = plan(counts, spare_slots)
    check_invariants(counts, first, spare_slots)
    check_invariants(counts, plan(counts, spare_slots, blind=True), spare_slots)
    again = plan(counts.clone(), spare_slots)
    for field in ("slot_expert", "slot_take", "home_keep"):
        assert torch.equal(getattr(first, field), getattr(again, field))


class _HostReads(TorchDispatchMode):
    """Records every op that copies a tensor value to the host (``.item()``, ``.tolist()``, ``bool(t)``)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


def test_planner_never_reads_values_on_the_host(loads):
    with _HostReads() as mode:
        plan(loads[0, :16], 1)
    assert mode.reads == []


def test_balance_at_16_ranks_one_slot_and_64_ranks_two_slots(loads):
    for ranks, spare_slots in [(16, 1), (64, 2)]:
        for step in range(0, loads.shape[0], 3):
            counts = loads[step, :ranks]
            assert plan_costs(plan(counts, 0), RANKS_PER_NODE).max_over_mean > 1.5  # far from balanced unaided
            assert plan_costs(plan(counts, spare_slots), RANKS_PER_NODE).max_over_mean <= 1.06


WEIGHTS = tuple(i / 8 for i in range(9))
BALANCE_BOUND = reference.BALANCE_BOUND  # max/mean rank load (tokens computed per rank) every plan must meet


def inter_node_clones(p, ranks_per_node):
    """Counted here from the plan's slots, not with the plugin's ``plan_costs``."""
    used = (p.slot_expert >= 0).nonzero().flatten()
    clone_node = used // p.spare_slots // ranks_per_node
    home_node = p.slot_expert[used] // p.experts_per_rank // ranks_per_node
    return int((clone_node != home_node).sum())


def max_over_mean(p):
    load = p.rank_load().double()
    return float(load.max() / load.mean())


def clones_by_weight(counts, ranks_per_node, spare_slots=1):
    """Inter-node clones of the plan picked at each of WEIGHTS (the candidates do not depend on the weight, so they
    are computed once); every picked plan must keep max/mean <= BALANCE_BOUND."""
    ranks = counts.shape[0]
    candidates = candidate_plans(counts, experts_per_rank=counts.shape[1] // ranks, spare_slots=spare_slots,
                                 ranks_per_node=ranks_per_node)
    clones = []
    for weight in WEIGHTS:
        p = pick_plan(candidates, ranks_per_node, weight)
        assert max_over_mean(p) <= BALANCE_BOUND, weight
        clones.append(inter_node_clones(p, ranks_per_node))
    assert all(a >= b for a, b in zip(clones, clones[1:], strict=False)), clones  # never rises with the weight
    return clones


def test_inter_node_clones_within_1_2x_of_the_exact_optimum_at_8_ranks():
    """8 ranks on 2 nodes, 32 experts, one spare slot, 9 loads (3 seeds): inter-node clones never rise with the
    weight (0 -> 0.25 used to rise 23 -> 27 here) and at full weight are within 1.2x of the exact MILP optimum."""
    ranks, ranks_per_node, experts = 8, 4, 32
    ours = optimum = 0
    for seed in range(3):
        for counts in skewed_counts(3, ranks, experts, tokens_per_rank=512, seed=seed):
            ours += clones_by_weight(counts, ranks_per_node)[-1]
            exact = reference.milp_fewest_inter_node_clones(counts.sum(0).tolist(), ranks_per_node, experts // ranks, 1)
            assert exact.optimal
            optimum += exact.clones
    assert optimum > 0 and ours <= 1.2 * optimum, (ours, optimum)  # measured 11 vs 11 (12 before repacking)


# Full weight over the per-node lower bound, as measured (16: 2 vs 2 clones, 32: 12 vs 10, 64: 33 vs 29; 2 / 13 / 35
# before every candidate was repacked (leftover inter-node pieces moved into slots freed on their own node) and the
# candidate whose exports go to the roomiest node first, which fails the 32- and 64-rank bounds; 3 / 13 / 38 before the
# receivers of exports were picked by the fewest pieces to shed and the interleaved-exports candidate). The exact
# optimum sits between: `python benchmarks/taot_placement.py --reference` prints the MILP's placement and bound per
# load.
LOWER_BOUND_RATIO = {16: 1.2, 32: 1.2, 64: 1.14}


@pytest.mark.parametrize("ranks", [16, 32, 64])
def test_inter_node_clones_fall_with_the_weight_balanced_and_near_the_lower_bound(loads, ranks):
    """Weights 0..1 in steps of 1/8 on four fixed loads (seeds 0-2): per load, inter-node clones never rise with
    the weight and every plan keeps max/mean <= 1.06; at full weight the total is within LOWER_BOUND_RATIO of the
    per-node lower bound and far below the topology-blind plan's."""
    steps = range(0, loads.shape[0], 3)
    per_step = [clones_by_weight(loads[step, :ranks], RANKS_PER_NODE) for step in steps]
    blind, full = sum(c[0] for c in per_step), sum(c[-1] for c in per_step)
    bound = sum(reference.per_node_lower_bound(loads[step, :ranks].sum(0).tolist(), RANKS_PER_NODE, EXPERTS // ranks)
                for step in steps)
    assert bound > 0 and full <= LOWER_BOUND_RATIO[ranks] * bound, (full, bound)
    assert blind >= 2 * full, (blind, full)


@pytest.mark.parametrize("ranks", [16, 32, 64])
def test_with_two_spare_slots_inter_node_clones_are_within_1_2x_of_the_lower_bound(loads, ranks):
    """Two spare slots per rank, the same four loads and weights: per load monotone and balanced, and at full weight
    within 1.2x of the per-node lower bound -- so of the exact optimum, which cannot beat the bound (measured 2 vs 2,
    10 vs 10, 30 vs 29) -- and at most half the topology-blind plan's."""
    steps = range(0, loads.shape[0], 3)
    per_step = [clones_by_weight(loads[step, :ranks], RANKS_PER_NODE, spare_slots=2) for step in steps]
    blind, full = sum(c[0] for c in per_step), sum(c[-1] for c in per_step)
    bound = sum(reference.per_node_lower_bound(loads[step, :ranks].sum(0).tolist(), RANKS_PER_NODE, EXPERTS // ranks)
                for step in steps)
    assert bound > 0 and full <= 1.2 * bound, (full, bound)
    assert blind >= 2 * full, (blind, full)


def test_plan_replicas_is_the_pick_among_the_candidates(loads):
    counts = loads[3, :32]
    candidates = candidate_plans(counts, experts_per_rank=4, spare_slots=1, ranks_per_node=RANKS_PER_NODE)
    assert len(candidates) == 7
    picked, planned = pick_plan(candidates, RANKS_PER_NODE, 0.5), plan(counts, 1)
    for field in ("slot_expert", "slot_take", "home_keep"):
        assert torch.equal(getattr(picked, field), getattr(planned, field))


def test_balanced_load_makes_no_clones_and_zero_slots_keep_everything_home():
    counts = torch.full((8, 16), 100, dtype=torch.int64)
    assert (plan(counts, 2).slot_expert == -1).all()
    skewed = skewed_counts(1, 8, 16, tokens_per_rank=256, seed=1)[0]
    unreplicated = plan(skewed, 0)
    assert unreplicated.slot_expert.numel() == 0 and torch.equal(unreplicated.home_keep, skewed)


def test_rejects_counts_that_do_not_match_the_layout_and_weights_outside_0_1():
    with pytest.raises(ValueError, match="128 experts; 16 ranks x 4"):
        plan_replicas(torch.zeros(16, 128, dtype=torch.int64), experts_per_rank=4, spare_slots=1,
                      ranks_per_node=8, topology_weight=0.5)
    with pytest.raises(ValueError, match=r"topology_weight must be in \[0, 1\] \(got 1.5\)"):
        plan_replicas(torch.zeros(16, 64, dtype=torch.int64), experts_per_rank=4, spare_slots=1,
                      ranks_per_node=8, topology_weight=1.5)
