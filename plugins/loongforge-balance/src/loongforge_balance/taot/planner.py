"""The per-step replica planner: which hot experts to clone into which spare slots, and which tokens go there.

Why a planner of its own: expert parallelism places expert ``e`` on rank ``e // experts_per_rank`` (megatron's
contiguous layout), so one popular expert makes its rank the straggler of every all-to-all. Each rank keeps
``spare_slots`` empty expert slots; every step the planner copies the experts that overload their home rank into
slots on under-loaded ranks and reroutes the overflow tokens to the copies.

Properties the execution relies on:

- pure tensor arithmetic on int64 tensors (no ``.item()``, no ``.tolist()``, no data-dependent Python branch),
  so it never waits for the device; the loop runs a fixed ``num_ranks * spare_slots`` times and an iteration
  that finds nothing worth moving changes nothing;
- deterministic: integer loads and first-index ``argmax`` tie-breaks, so every rank computes the same plan from
  the same all-gathered counts and no plan has to be broadcast;
- topology aware (``topology_weight > 0``), in two kinds of move, at most one slot filled per iteration:
  first the *forced* inter-node moves: what a node holds above its ranks' capacity (``high`` each) cannot be
  balanced inside it whatever the weight, so it leaves in the largest pieces (fewest inter-node clones) before
  any intra-node move can spend the big experts on small local fixes; then water-filling, where a move to another
  node counts ``1 - topology_weight`` times its tokens. Clones take their tokens first from source ranks on their
  own node (fewer cross-node token copies). ``topology_weight=0`` is the topology-blind planner (no forced moves,
  no discount).

Greedy water-filling: repeatedly take the most loaded rank if it is above ``high``, and among (its home expert,
receiver with a free slot) pairs the one that moves the most tokens (ties: the receiver left with the least room),
where a move never takes the donor below the mean nor the receiver above ``high`` (the exact mean times
``1 + RECEIVER_SLACK``, rounded down), so a balanced plan has max/mean <= 1.06. Ranks at or below ``high`` never
shed: moving their few tokens would spend a slot that a hot rank needs.

Measured against independent references (tests/balance/test_taot_planner.py): inter-node clones within 1.6x of
an exact MILP optimum at 8 ranks and within 2.1x of a per-node lower bound at 16-64 ranks; not yet within 1.2x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Receivers may be filled up to this fraction above the mean (donors shed down to the mean). With one spare
#: slot a receiver takes one expert's tokens, so rooms rarely add up exactly to a donor's excess; exact
#: filling strands the remainders and leaves donors at 1.1-1.2x the mean, while 6% headroom (the max/mean the
#: plan promises) absorbs them.
RECEIVER_SLACK = 0.06


@dataclass(frozen=True)
class ReplicaPlan:
    """Where every (source rank, expert) token count is computed this step.

    ``slot_expert[j]`` is the expert cloned into spare slot ``j`` (slot ``j`` lives on rank ``j // spare_slots``),
    -1 when the slot stays empty. ``slot_take[j, s]`` tokens from source rank ``s`` go to that clone, and
    ``home_keep[s, e]`` tokens from ``s`` stay with expert ``e`` at its home rank, so that for every expert
    ``home_keep[:, e] + sum(slot_take[slot_expert == e])`` equals the routed counts.
    """

    slot_expert: torch.Tensor
    slot_take: torch.Tensor
    home_keep: torch.Tensor
    experts_per_rank: int
    spare_slots: int

    @property
    def num_ranks(self) -> int:
        return self.home_keep.shape[0]

    def flow(self) -> torch.Tensor:
        """Tokens from source rank to (destination rank, instance): ``[R, R, experts_per_rank + spare_slots]``.

        A rank's instances are its home experts in order, then its spare slots in order; this is the order in
        which a destination lays out what it receives, and what the all-to-all split sizes are summed from.
        """
        ranks, local, spare = self.num_ranks, self.experts_per_rank, self.spare_slots
        home = self.home_keep.view(ranks, ranks, local)
        clones = self.slot_take.t().reshape(ranks, ranks, spare)
        return torch.cat([home, clones], dim=2)

    def rank_load(self) -> torch.Tensor:
        """Tokens each rank computes: ``[R]``."""
        return self.flow().sum(dim=(0, 2))


def node_of(num_ranks: int, ranks_per_node: int, device: torch.device | None = None) -> torch.Tensor:
    """Node index of every rank (ranks are numbered node by node, as torchrun numbers them)."""
    return torch.arange(num_ranks, device=device) // ranks_per_node


def plan_replicas(
    counts: torch.Tensor,
    *,
    experts_per_rank: int,
    spare_slots: int,
    ranks_per_node: int,
    topology_weight: float,
) -> ReplicaPlan:
    """Plan this step's clones from ``counts[s, e]``, the tokens source rank ``s`` routes to expert ``e``.

    ``counts`` must be identical on every rank (all-gathered); the plan then is too.
    """
    counts = counts.to(torch.int64)
    ranks, experts = counts.shape
    if experts != ranks * experts_per_rank:
        raise ValueError(f"counts has {experts} experts; {ranks} ranks x {experts_per_rank} experts per rank "
                         f"expected")
    if spare_slots < 0 or ranks_per_node < 1:
        raise ValueError(f"spare_slots must be >= 0 and ranks_per_node >= 1 (got {spare_slots}, {ranks_per_node})")
    state = _PlanState(counts, experts_per_rank, spare_slots, ranks_per_node)
    scale = 1 << 10
    discount = min(int(round(topology_weight * scale)), scale - 1)  # inter-node moves still rank by size
    # Indices stay 1-element tensors: indexing with a 0-d tensor would call ``.item()`` (a device sync).
    for _ in range(ranks * spare_slots):
        move = _water_filling_move(state, scale, discount)
        if topology_weight > 0:  # a config value, not data: no device sync
            forced = _forced_inter_node_move(state)
            move = tuple(torch.where(forced[2] > 0, f, m) for f, m in zip(forced, move, strict=True))
        state.apply(*move)
    return ReplicaPlan(state.slot_expert, state.slot_take, state.keep, experts_per_rank, spare_slots)


class _PlanState:
    """The plan under construction and the loads it leaves (all int64 tensors, updated in place)."""

    def __init__(self, counts: torch.Tensor, experts_per_rank: int, spare_slots: int, ranks_per_node: int) -> None:
        ranks, experts = counts.shape
        device = counts.device
        self.experts_per_rank, self.spare_slots = experts_per_rank, spare_slots
        self.nodes = node_of(ranks, ranks_per_node, device)
        self.rank_ids = torch.arange(ranks, device=device)
        self.home_rank = torch.arange(experts, device=device) // experts_per_rank
        self.node_size = torch.zeros(-(-ranks // ranks_per_node), dtype=torch.int64, device=device).index_add_(
            0, self.nodes, torch.ones_like(self.nodes))
        self.keep = counts.clone()
        self.home_load = counts.sum(dim=0)  # tokens still at each expert's home instance
        self.load = self.home_load.view(ranks, experts_per_rank).sum(dim=1)
        self.target = (self.load.sum() + ranks - 1) // ranks  # the mean, rounded up: donors shed down to it
        # Rounded down, so a rank filled to ``high`` stays within ``1 + RECEIVER_SLACK`` times the exact mean.
        self.high = (self.load.sum().to(torch.float64) * (1 + RECEIVER_SLACK) / ranks).to(torch.int64)
        self.free = torch.full((ranks,), spare_slots, dtype=torch.int64, device=device)
        self.has_clone = torch.zeros(ranks, experts, dtype=torch.bool, device=device)
        self.slot_expert = torch.full((ranks * spare_slots,), -1, dtype=torch.int64, device=device)
        self.slot_take = torch.zeros(ranks * spare_slots, ranks, dtype=torch.int64, device=device)

    def node_load(self) -> torch.Tensor:
        return torch.zeros_like(self.node_size).index_add_(0, self.nodes, self.load)

    def apply(self, expert: torch.Tensor, receiver: torch.Tensor, amount: torch.Tensor) -> None:
        """Clone ``expert`` into a free slot of ``receiver`` with ``amount`` tokens (nothing when it is 0)."""
        used = amount > 0
        donor = self.home_rank[expert]
        take = _take_from_sources(self.keep[:, expert].squeeze(1), amount, self.nodes, self.nodes[receiver],
                                  self.rank_ids.shape[0])
        spare = self.spare_slots
        slot = receiver * spare + (spare - self.free[receiver]).clamp(max=spare - 1)
        self.slot_expert[slot] = torch.where(used, expert, self.slot_expert[slot])
        self.slot_take[slot] = torch.where(used.unsqueeze(1), take.unsqueeze(0), self.slot_take[slot])
        self.keep.index_add_(1, expert, -take.unsqueeze(1))
        self.home_load.index_add_(0, expert, -amount)
        self.load.index_add_(0, torch.cat([donor, receiver]), torch.cat([-amount, amount]))
        self.free.index_add_(0, receiver, -used.to(torch.int64))
        self.has_clone[receiver, expert] = self.has_clone[receiver, expert] | used


def _forced_inter_node_move(state: _PlanState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The largest move of load that must leave its node: (expert, receiver, amount), amount 0 when none is left.

    A node holding more than its share (its ranks times the mean) cannot be balanced inside it, so that excess
    crosses nodes whatever the weight. Moving it in the largest pieces (the biggest home load a donor above the
    mean can shed, to the receiver with the most room on a node below its share) needs the fewest inter-node
    clones; doing it before any intra-node move keeps the big experts for it (an intra-node move that clones
    a big expert first leaves only small ones to carry the node's excess, hence more inter-node clones).
    """
    node_load = state.node_load()
    share = state.node_size * state.high  # what the node's ranks can hold
    node_excess = (node_load - share).clamp(min=0)
    node_room = (share - node_load).clamp(min=0)
    donor_excess = (state.load - state.target).clamp(min=0)
    expert_node = state.nodes[state.home_rank]
    give = torch.minimum(state.home_load, torch.minimum(donor_excess[state.home_rank], node_excess[expert_node]))
    room = torch.minimum((state.high - state.load).clamp(min=0), node_room[state.nodes])
    room = torch.where(state.free > 0, room, 0)
    movable = torch.minimum(give.unsqueeze(1), room.unsqueeze(0))  # [E, R]
    movable = torch.where((expert_node.unsqueeze(1) != state.nodes.unsqueeze(0)) & ~state.has_clone.t(), movable, 0)
    best = _best_fit(movable, movable, room)
    ranks = state.rank_ids.shape[0]
    return best // ranks, best % ranks, movable.flatten()[best]


def _water_filling_move(state: _PlanState, scale: int, discount: int) -> tuple[torch.Tensor, ...]:
    """The best move off the most loaded rank: (expert, receiver, amount), amount 0 when none is worth making.

    Among (its home expert, receiver with a free slot) pairs the one that moves the most tokens, where a move
    never takes the donor below the mean nor the receiver above ``high``, and a move to another node counts
    ``1 - topology_weight`` times its tokens.
    """
    local = state.experts_per_rank
    load = state.load
    donor = torch.argmax(load).view(1)
    donor_experts = donor * local + torch.arange(local, device=load.device)  # [L]
    excess = torch.where(load[donor] > state.high, load[donor] - state.target, 0)  # [1]: only ranks above high shed
    room = (state.high - load).clamp(min=0)  # [R]
    movable = torch.minimum(state.home_load[donor_experts].unsqueeze(1), torch.minimum(excess, room).unsqueeze(0))
    eligible = ((state.free > 0) & (state.rank_ids != donor)).unsqueeze(0) & ~state.has_clone[:, donor_experts].t()
    movable = torch.where(eligible, movable, 0)  # [L, R]
    worth = scale - discount * (state.nodes != state.nodes[donor]).to(torch.int64)  # [R]
    score = torch.where(movable > 0, movable * worth, -1)
    best = _best_fit(score, movable, room)
    ranks = state.rank_ids.shape[0]
    return donor * local + best // ranks, best % ranks, movable.flatten()[best]


def _best_fit(score: torch.Tensor, movable: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """Flat index of the best ``[candidate, receiver]`` score; among equal scores, the receiver left with the
    least room after the move (best fit), so that large rooms stay for the large moves still to come."""
    left = room.unsqueeze(0) - movable
    left = torch.where(score == score.max(), left, torch.iinfo(torch.int64).max)
    return torch.argmin(left).view(1)


def _take_from_sources(available: torch.Tensor, amount: torch.Tensor, nodes: torch.Tensor, node: torch.Tensor,
                       ranks: int) -> torch.Tensor:
    """``amount`` tokens out of ``available[s]``, taken from sources on ``node`` first, then by rank order."""
    order = torch.argsort((nodes != node).to(torch.int64) * ranks + torch.arange(ranks, device=nodes.device))
    sorted_available = available[order]
    before = torch.cumsum(sorted_available, dim=0) - sorted_available
    sorted_take = torch.minimum((amount - before).clamp(min=0), sorted_available)
    return torch.zeros_like(available).scatter(0, order, sorted_take)
