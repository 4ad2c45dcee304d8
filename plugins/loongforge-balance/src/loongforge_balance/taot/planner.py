"""The per-step replica planner: which hot experts to clone into which spare slots, and which tokens go there.

Why a planner of its own: expert parallelism places expert ``e`` on rank ``e // experts_per_rank`` (megatron's
contiguous layout), so one popular expert makes its rank the straggler of every all-to-all. Each rank keeps
``spare_slots`` empty expert slots; every step the planner copies the experts that overload their home rank into
slots on under-loaded ranks and reroutes the overflow tokens to the copies.

Properties the execution relies on:

- pure tensor arithmetic on int64 tensors (no ``.item()``, no ``.tolist()``, no data-dependent Python branch),
  so it never waits for the device; each greedy pass runs a fixed ``num_ranks * spare_slots`` iterations (an
  iteration that finds nothing to move changes nothing, so later ones find nothing either);
- deterministic: integer loads and first-index tie-breaks, so every rank computes the same plan from the same
  all-gathered counts and no plan has to be broadcast;
- balanced: a rank sheds only while above ``high`` (the exact mean times ``1 + RECEIVER_SLACK``, rounded down),
  never below the mean, and a receiver is never filled above ``high``, so a plan the greedy completes has
  max/mean <= 1.06.

One greedy pass, one move (or two, see chains) per iteration, first of:

1. *forced inter-node move*: a node holding more than its ranks' capacity (``high`` each) must send the excess to
   other nodes whatever the weight; its most loaded rank sends its largest piece, as much as takes it down to the
   mean, to a rank on a node with room. Sending whole donors (not just the node's excess) leaves the node room to
   balance the rest inside it; pieces are as large as a receiver takes, so few clones cross nodes;
2. *intra-node move*: the most loaded rank above ``high`` that can shed inside its node does, to a receiver on its
   node;
3. *any move*: the same, anywhere (only when the node's slots or rooms ran out).

A move is chosen bin-covering style: one that takes the donor down to ``high`` wins, going to the receiver it
fits best (the least room left, so large rooms stay for large moves); if none does, the largest move.

*Chains* (the third candidate below): a receiver of a forced move may take more than its room when it can pass
the overflow on to one rank of its own node (one of its home experts, best fit) in the same iteration. The
exact optimum does this (an inter-node piece lands on a rank that then sheds its own experts locally), and it
lets one inter-node clone carry a whole donor's excess instead of two smaller ones.

``topology_weight`` picks among seven candidate plans, computed independently of the weight: topology-blind
(the world seen as one node), node-aware, node-aware with chains, node-aware with chains where ranks of nodes
within their capacity shed inside their node before any forced move (imports otherwise take the slots such a node
needs for itself, and its own hot expert then has to leave it), *export first*: every node above its capacity
first sends its biggest whole expert pieces to other nodes until its excess is gone -- the pieces the per-node
lower bound counts -- to the receivers whose overflow their own biggest experts cover in the fewest pieces (each
takes a slot of their node), and the pass then balances each node inside it (receivers pass their own experts on),
and *interleaved exports*: the same export moves, capped at what a receiver can hold or pass on to one rank of its
node, interleaved with the settling of nodes within capacity, so each import is passed on before the next lands,
and the same with each export sent to the node with the most room first (which then has the most room to settle it).
On more than one node every candidate is then *repacked* (:func:`_repack`): leftover inter-node pieces move into
slots of their own node, freed by merging two intra-node clones of one rank's experts; this only lowers clones or
inter-node clones.
Export first needs slots for that settling: with two spare slots per rank it is the one picked at full weight;
with one, interleaving leaves each import the slots it needs. It keeps the plan minimising ``(1 - w) * clones
+ w * inter-node clones`` among those meeting the balance bound (ties: that order). Because the candidates do not
depend on ``w``, inter-node clones never rise with ``w``: if ``a`` is kept at ``w1`` and ``b`` at ``w2 > w1``,
adding the two optimality inequalities gives ``(w2 - w1) * (inter_b - inter_a) <= 0`` after dividing by ``1 - w``
(the exchange argument for a weighted sum over a fixed set).

Measured against independent references (tests/balance/test_taot_planner.py) at full weight: an exact MILP
(8 ranks: 11 vs 11 inter-node clones) and the per-node lower bound, which no balanced plan beats: with two spare
slots per rank 1.0x / 1.0x / 1.03x of it at 16 / 32 / 64 ranks (2 / 10 / 30 clones on four loads vs 2 / 10 / 29);
with one slot 1.0x / 1.2x / 1.14x (2 / 12 / 33), where the exact MILP reaches the bound (2 / 10 / 29): one slot a
rank leaves too little room to settle the imports, and the greedy passes and the repacking cannot pack it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Receivers may be filled up to this fraction above the mean (donors shed down to the mean). With one spare
#: slot a receiver takes one expert's tokens, so rooms rarely add up exactly to a donor's excess; exact
#: filling strands the remainders and leaves donors at 1.1-1.2x the mean, while 6% headroom (the max/mean the
#: plan promises) absorbs them.
RECEIVER_SLACK = 0.06

#: Move keys pack token counts into bit fields of one int64 (``_bin_covering_key``): a step may route at most this
#: many (token, expert) pairs (a billion; 1024 ranks x 16k tokens x top-8 is 134M).
TOKEN_LIMIT = 1 << 30


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
    if not 0.0 <= topology_weight <= 1.0:
        raise ValueError(f"topology_weight must be in [0, 1] (got {topology_weight})")
    return pick_plan(candidate_plans(counts, experts_per_rank=experts_per_rank, spare_slots=spare_slots,
                                     ranks_per_node=ranks_per_node), ranks_per_node, topology_weight)


def candidate_plans(counts: torch.Tensor, *, experts_per_rank: int, spare_slots: int,
                    ranks_per_node: int) -> list[ReplicaPlan]:
    """The plans ``topology_weight`` chooses among (topology-blind, node-aware, with chains, with chains and
    nodes within capacity settled first, export first, interleaved exports, interleaved exports to the roomiest node
    first); none depends on the weight, which is what makes inter-node clones monotone in it (module docstring)."""
    counts = counts.to(torch.int64)
    ranks = counts.shape[0]
    blind = _greedy(counts, experts_per_rank, spare_slots, ranks, chains=False)
    if ranks_per_node >= ranks:  # one node: topology changes nothing
        return [blind]
    node_aware = [_greedy(counts, experts_per_rank, spare_slots, ranks_per_node, chains=chains, settle_first=settle)
                  for chains, settle in ((False, False), (True, False), (True, True))]
    export_first = _greedy(counts, experts_per_rank, spare_slots, ranks_per_node, chains=False, export_first=True)
    interleaved = [_greedy(counts, experts_per_rank, spare_slots, ranks_per_node, chains=False, settle_first=True,
                           interleaved_exports=True, roomiest_node_first=roomiest) for roomiest in (False, True)]
    return [_repack(plan, ranks_per_node) for plan in (blind, *node_aware, export_first, *interleaved)]


def pick_plan(candidates: list[ReplicaPlan], ranks_per_node: int, topology_weight: float) -> ReplicaPlan:
    """The candidate minimising ``(1 - w) * clones + w * inter-node clones``, balanced ones first (first on ties).

    Selected with ``torch.where``-style tensor ops, not a Python ``min``, so no value is read on the host.
    """
    ranks = candidates[0].num_ranks
    high = _high(candidates[0].rank_load().sum(), ranks)
    scale = 1 << 10
    weight = int(round(topology_weight * scale))
    scores = []
    for plan in candidates:
        used = plan.slot_expert >= 0
        slot_node = torch.arange(used.shape[0], device=used.device) // max(plan.spare_slots, 1) // ranks_per_node
        home_node = plan.slot_expert.clamp(min=0) // plan.experts_per_rank // ranks_per_node
        inter = (used & (slot_node != home_node)).sum()
        unbalanced = (plan.rank_load().max() > high).to(torch.int64)
        scores.append(unbalanced * (scale * ranks * plan.spare_slots + 1) + (scale - weight) * used.sum()
                      + weight * inter)
    best = torch.argmin(torch.stack(scores)).view(1)  # first index among equal scores
    fields = ("slot_expert", "slot_take", "home_keep")
    picked = {f: torch.stack([getattr(p, f) for p in candidates]).index_select(0, best).squeeze(0) for f in fields}
    return ReplicaPlan(**picked, experts_per_rank=candidates[0].experts_per_rank,
                       spare_slots=candidates[0].spare_slots)


def _high(total: torch.Tensor, ranks: int) -> torch.Tensor:
    """The most a rank may hold: the exact mean times ``1 + RECEIVER_SLACK``, rounded down."""
    return (total.to(torch.float64) * (1 + RECEIVER_SLACK) / ranks).to(torch.int64)

Move = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (expert, receiver, amount), 1-element tensors


def _greedy(counts: torch.Tensor, experts_per_rank: int, spare_slots: int, ranks_per_node: int, *,
            chains: bool, settle_first: bool = False, export_first: bool = False,
            interleaved_exports: bool = False, roomiest_node_first: bool = False) -> ReplicaPlan:
    """One greedy pass (module docstring): forced inter-node, then intra-node, then any move, one per iteration;
    with ``settle_first``, a rank above ``high`` on a node within its capacity sheds inside its node before any
    forced move (so imports do not take the slots that node needs for itself); with ``export_first``, every node's
    excess leaves first in its biggest pieces (:func:`_export_move`), and the pass then balances what is left; with
    ``interleaved_exports``, export moves capped at what the receiver can hold or pass on to one rank of its node
    take the forced moves' place, so (with ``settle_first``) each import is passed on inside its node before the next
    one lands; ``roomiest_node_first`` sends each export to the node with the most room (:func:`_export_move`)."""
    state = _PlanState(counts, experts_per_rank, spare_slots, ranks_per_node)
    one_node = ranks_per_node >= counts.shape[0]  # a config value, not data: no device sync
    if export_first and not one_node:
        for _ in range(counts.shape[0] * spare_slots):
            state.apply(*_export_move(state))
    for _ in range(counts.shape[0] * spare_slots):
        host = state.can_host()
        local, anywhere = _shed_moves(state, host)
        if one_node:
            move = local
        else:
            inter_node = (_export_move(state, chain_host=host, roomiest_node_first=roomiest_node_first)
                          if interleaved_exports
                          else _forced_move(state, host, chains))
            move = _first_nonempty(inter_node, local, anywhere)
            if settle_first:
                settle = _shed_moves(state, host, donors=state.node_excess()[state.nodes] <= 0)[0]
                move = _first_nonempty(settle, move)
        state.apply(*move)
        if chains:  # a forced move beyond the receiver's room: the receiver passes the overflow on
            state.apply(*_chain_move(state, move[1]))
    return ReplicaPlan(state.slot_expert, state.slot_take, state.keep, experts_per_rank, spare_slots)


def _repack(plan: ReplicaPlan, ranks_per_node: int) -> ReplicaPlan:
    """A finished plan, locally improved: each of a fixed ``num_ranks // 4`` iterations makes the first of

    1. *relocation*: an inter-node clone (the smallest first) moves to a rank of its expert's node with a free slot
       that can take its tokens, passing what it cannot hold on through one existing clone of its own experts;
    2. *merge*: the smaller of two intra-node clones of one rank's experts hands its tokens to the other's host (which
       passes its overflow on the same way), so its slot frees for a relocation.

    Why: the greedy passes leave small leftover pieces (a donor's last ``high - mean`` tokens) on other nodes because
    every slot of the donor's node is taken, often by two pieces of one donor that one host could take together.
    Relocations cut inter-node clones and keep the clone count, merges cut clones and keep inter-node ones, and no
    rank goes above ``high``: the plan only gets better for every ``topology_weight``, and the pass does not depend on
    the weight, so the monotonicity argument (module docstring) still holds. Moves are few (at most 9 per candidate
    on the test loads at 64 ranks), hence the short fixed loop: a pass cut short is only less improved.
    """
    state = _Repacking(plan, ranks_per_node)
    for _ in range(plan.num_ranks // 4 if plan.spare_slots else 0):
        room = state.room()
        reach = room + state.best_outlet(room)[0]  # [R]: what a rank can take, passing the rest on
        state.apply(*_first_nonempty(_relocation(state, reach), _merge(state, reach)))
    return ReplicaPlan(state.slot_expert, state.slot_take, state.keep, plan.experts_per_rank, plan.spare_slots)


Rewrite = tuple[torch.Tensor, ...]  # (dropped slot, target slot, expert, amount), 1-element tensors


class _Repacking:
    """A finished plan under local improvement (int64 tensors, updated in place) and the values moves are chosen on."""

    def __init__(self, plan: ReplicaPlan, ranks_per_node: int) -> None:
        ranks, device = plan.num_ranks, plan.home_keep.device
        self.local, self.spare = plan.experts_per_rank, plan.spare_slots
        self.slot_expert, self.slot_take = plan.slot_expert.clone(), plan.slot_take.clone()
        self.keep = plan.home_keep.clone()
        self.nodes = node_of(ranks, ranks_per_node, device)
        self.source_order = _source_order(self.nodes)
        self.host = torch.arange(ranks * self.spare, device=device) // max(self.spare, 1)  # [S]: the slot's rank
        self.rank_ids = torch.arange(ranks, device=device)
        self.high = _high(self.keep.sum() + self.slot_take.sum(), ranks)

    def load(self) -> torch.Tensor:
        """``[R]``: tokens each rank computes."""
        home = self.keep.sum(dim=0).view(-1, self.local).sum(dim=1)
        return home.index_add(0, self.host, self.slot_take.sum(dim=1))

    def room(self) -> torch.Tensor:
        """``[R]``: what each rank can still take before ``high``."""
        return (self.high - self.load()).clamp(min=0)

    def best_outlet(self, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R]`` each: the most one existing clone of a rank's experts can still take (bounded by its host's room and
        the tokens left at home), and that clone's slot."""
        used = self.slot_expert >= 0
        expert = self.slot_expert.clamp(min=0)
        outlet = torch.minimum(room[self.host], self.keep.sum(dim=0)[expert])
        mine = used.unsqueeze(0) & (expert // self.local == self.rank_ids.unsqueeze(1))  # [R, S]
        per_rank = torch.where(mine, outlet.unsqueeze(0), -1)
        return per_rank.amax(dim=1).clamp(min=0), torch.argmax(per_rank, dim=1)

    def apply(self, dropped: torch.Tensor, target: torch.Tensor, expert: torch.Tensor, amount: torch.Tensor) -> None:
        """Return ``dropped``'s tokens home, put ``amount`` tokens of ``expert`` on slot ``target``, then pass the
        target host's overflow above ``high`` on through its best outlet (nothing when ``amount`` is 0)."""
        valid = amount > 0
        back = torch.where(valid.unsqueeze(1), self.slot_take[dropped], 0)  # [1, R]
        self.keep.index_add_(1, self.slot_expert[dropped].clamp(min=0), back.t())
        self.slot_take[dropped] -= back
        self.slot_expert[dropped] = torch.where(valid, -1, self.slot_expert[dropped])
        self._add(target, expert, amount)
        host = self.host[target]
        overflow = torch.minimum((self.load()[host] - self.high).clamp(min=0), amount)  # none that was there before
        outlet = self.best_outlet(self.room())[1][host]
        self._add(outlet, self.slot_expert[outlet].clamp(min=0), overflow)  # no overflow where it has no outlet

    def _add(self, slot: torch.Tensor, expert: torch.Tensor, amount: torch.Tensor) -> None:
        """``amount`` more tokens of ``expert`` from its home to ``slot`` (own node's sources first)."""
        take = _take_from_sources(self.keep[:, expert].squeeze(1), amount,
                                  self.source_order[self.host[slot]].squeeze(0))
        self.keep.index_add_(1, expert, -take.unsqueeze(1))
        self.slot_take[slot] += take.unsqueeze(0)
        self.slot_expert[slot] = torch.where(amount > 0, expert, self.slot_expert[slot])


def _relocation(state: _Repacking, reach: torch.Tensor) -> Rewrite:
    """The smallest inter-node clone, to the first rank of its expert's node that has a free slot, holds no clone of
    it and can take it (``reach``: its room plus its best outlet)."""
    ranks, spare, local = state.rank_ids.shape[0], state.spare, state.local
    used = state.slot_expert >= 0
    expert = state.slot_expert.clamp(min=0)
    amount = state.slot_take.sum(dim=1)  # [S]
    home = expert // local
    free = (~used).view(ranks, spare)
    holds = torch.zeros(ranks * local * ranks, dtype=torch.int64, device=used.device).index_add_(
        0, state.host * local * ranks + expert, used.to(torch.int64)).view(ranks, -1) > 0  # [R, E]
    inter = used & (state.nodes[state.host] != state.nodes[home])  # [S]
    valid = (inter.unsqueeze(1) & (state.nodes.unsqueeze(0) == state.nodes[home].unsqueeze(1))  # [S, R]
             & (state.rank_ids.unsqueeze(0) != home.unsqueeze(1)) & free.any(dim=1).unsqueeze(0)
             & ~holds.t()[expert] & (reach.unsqueeze(0) >= amount.unsqueeze(1)))
    best = _lexicographic_first(valid, [-amount.unsqueeze(1).expand_as(valid)])
    slot, rank = best // ranks, best % ranks
    target = rank * spare + torch.argmax(free[rank].to(torch.int8), dim=1)
    return slot, target, expert[slot], torch.where(valid.flatten()[best], amount[slot], 0)


def _merge(state: _Repacking, reach: torch.Tensor) -> Rewrite:
    """The smallest intra-node clone whose tokens another intra-node clone of the same rank's experts can take on
    top of its own (tokens left at its home, its host's room plus best outlet)."""
    local = state.local
    used = state.slot_expert >= 0
    expert = state.slot_expert.clamp(min=0)
    amount = state.slot_take.sum(dim=1)  # [S]
    home = expert // local
    intra = used & (state.nodes[state.host] == state.nodes[home])
    at_home = state.keep.sum(dim=0)[expert]  # [S]
    slots = torch.arange(amount.shape[0], device=used.device)
    # row: the clone given up; column: the clone that takes its tokens (of its own expert, as many)
    available = at_home.unsqueeze(0) + torch.where(expert.unsqueeze(0) == expert.unsqueeze(1), amount.unsqueeze(1), 0)
    valid = (intra.unsqueeze(1) & intra.unsqueeze(0) & (home.unsqueeze(0) == home.unsqueeze(1))
             & (slots.unsqueeze(0) != slots.unsqueeze(1)) & (available >= amount.unsqueeze(1))
             & (reach[state.host].unsqueeze(0) >= amount.unsqueeze(1)))
    best = _lexicographic_first(valid, [-amount.unsqueeze(1).expand_as(valid)])
    given_up, taker = best // amount.shape[0], best % amount.shape[0]
    return given_up, taker, expert[taker], torch.where(valid.flatten()[best], amount[given_up], 0)


def _first_nonempty(*moves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The first move (a :data:`Move` or a :data:`Rewrite`, amount last) with a positive amount (the last one when
    none has)."""
    chosen = moves[-1]
    for move in reversed(moves[:-1]):
        chosen = tuple(torch.where(move[-1] > 0, m, c) for m, c in zip(move, chosen, strict=True))
    return chosen


class _PlanState:
    """The plan under construction and the loads it leaves (all int64 tensors, updated in place)."""

    def __init__(self, counts: torch.Tensor, experts_per_rank: int, spare_slots: int, ranks_per_node: int) -> None:
        ranks, experts = counts.shape
        device = counts.device
        self.experts_per_rank, self.spare_slots = experts_per_rank, spare_slots
        self.nodes = node_of(ranks, ranks_per_node, device)
        self.same_node = self.nodes.unsqueeze(1) == self.nodes.unsqueeze(0)  # [R, R]
        self.rank_ids = torch.arange(ranks, device=device)
        self.source_order = _source_order(self.nodes)
        self.home_rank = torch.arange(experts, device=device) // experts_per_rank
        self.node_size = torch.zeros(-(-ranks // ranks_per_node), dtype=torch.int64, device=device).index_add_(
            0, self.nodes, torch.ones_like(self.nodes))
        self.keep = counts.clone()
        self.home_load = counts.sum(dim=0)  # tokens still at each expert's home instance
        self.load = self.home_load.view(ranks, experts_per_rank).sum(dim=1)
        self.target = (self.load.sum() + ranks - 1) // ranks  # the mean, rounded up: donors shed down to it
        self.high = _high(self.load.sum(), ranks)
        self.free = torch.full((ranks,), spare_slots, dtype=torch.int64, device=device)
        self.has_clone = torch.zeros(ranks, experts, dtype=torch.bool, device=device)
        self.slot_expert = torch.full((ranks * spare_slots,), -1, dtype=torch.int64, device=device)
        self.slot_take = torch.zeros(ranks * spare_slots, ranks, dtype=torch.int64, device=device)

    def node_excess(self) -> torch.Tensor:
        """``[nodes]``: each node's load above its ranks' capacity (``high`` each); negative where it has room."""
        node_load = torch.zeros_like(self.node_size).index_add_(0, self.nodes, self.load)
        return node_load - self.node_size * self.high

    def room(self) -> torch.Tensor:
        """What each rank can still receive: ``[R]``, 0 for a rank at ``high`` or without a free slot."""
        return torch.where(self.free > 0, (self.high - self.load).clamp(min=0), 0)

    def can_host(self) -> torch.Tensor:
        """``[R, R, L]``: receiver ``r`` may take a new clone of donor ``d``'s ``l``-th expert."""
        ranks, local = self.rank_ids.shape[0], self.experts_per_rank
        cloned = self.has_clone.view(ranks, ranks, local)  # [receiver, donor, l]
        return (self.room() > 0).view(ranks, 1, 1) & ~cloned & (self.rank_ids.view(-1, 1) != self.rank_ids).unsqueeze(2)

    def apply(self, expert: torch.Tensor, receiver: torch.Tensor, amount: torch.Tensor) -> None:
        """Clone ``expert`` into a free slot of ``receiver`` with ``amount`` tokens (nothing when it is 0)."""
        used = amount > 0
        donor = self.home_rank[expert]
        take = _take_from_sources(self.keep[:, expert].squeeze(1), amount, self.source_order[receiver].squeeze(0))
        spare = self.spare_slots
        slot = receiver * spare + (spare - self.free[receiver]).clamp(min=0, max=spare - 1)
        self.slot_expert[slot] = torch.where(used, expert, self.slot_expert[slot])
        self.slot_take[slot] = torch.where(used.unsqueeze(1), take.unsqueeze(0), self.slot_take[slot])
        self.keep.index_add_(1, expert, -take.unsqueeze(1))
        self.home_load.index_add_(0, expert, -amount)
        self.load.index_add_(0, torch.cat([donor, receiver]), torch.cat([-amount, amount]))
        self.free.index_add_(0, receiver, -used.to(torch.int64))
        self.has_clone[receiver, expert] = self.has_clone[receiver, expert] | used


def _shed_moves(state: _PlanState, host: torch.Tensor, donors: torch.Tensor | None = None) -> tuple[Move, Move]:
    """The best move of the most loaded rank above ``high`` that has one: inside its node, and anywhere.
    ``donors`` (``[R]`` bool), when given, limits which ranks may shed."""
    ranks, local = state.rank_ids.shape[0], state.experts_per_rank
    need = state.load - state.high  # [R]: > 0 for donors
    if donors is not None:
        need = torch.where(donors, need, 0)
    want = state.load - state.target
    room = state.room()
    pieces = torch.minimum(state.home_load.view(ranks, local), want.unsqueeze(1))  # [d, l]
    amount = torch.minimum(pieces.unsqueeze(0), room.view(-1, 1, 1))  # [r, d, l]
    valid = host & (need > 0).view(1, -1, 1) & (amount > 0)
    keys = [state.load.view(1, -1, 1).expand_as(amount), _bin_covering_key(amount, need.view(1, -1, 1),
                                                                         room.view(-1, 1, 1))]
    moves = []
    for allowed in (valid & state.same_node.unsqueeze(2), valid):
        moves.append(_move_at(_lexicographic_first(allowed, keys), amount, allowed, local))
    return moves[0], moves[1]


def _forced_move(state: _PlanState, host: torch.Tensor, chains: bool) -> Move:
    """The most loaded rank of the node furthest above its capacity sends a piece to another node with room."""
    local = state.experts_per_rank
    node_excess = state.node_excess()
    worst_node = torch.argmax(node_excess)
    donor = torch.argmax(torch.where(state.nodes == worst_node, state.load, -1)).view(1)
    need, want = state.load[donor] - state.high, state.load[donor] - state.target
    room = state.room()
    reach = room + _chain_reach(state, host) if chains else room
    reach = torch.minimum(reach, (-node_excess[state.nodes]).clamp(min=0))  # [R]
    piece = torch.minimum(state.home_load[donor * local + torch.arange(local, device=room.device)], want)  # [l]
    amount = torch.minimum(piece.unsqueeze(0), reach.unsqueeze(1)).unsqueeze(1)  # [r, 1, l]
    receiving = (node_excess[state.nodes] < 0) & (state.nodes != worst_node) & (state.load < state.high)
    valid = host[:, donor] & receiving.view(-1, 1, 1) & (amount > 0) & (node_excess.max() > 0)
    key = _bin_covering_key(amount, need.view(1, 1, 1), reach.view(-1, 1, 1), fits=amount <= room.view(-1, 1, 1))
    best = _lexicographic_first(valid, [key])
    receiver, flat_l = best // local, best % local
    return donor * local + flat_l, receiver, torch.where(valid.flatten()[best], amount.flatten()[best], 0)


def _export_move(state: _PlanState, chain_host: torch.Tensor | None = None, roomiest_node_first: bool = False) -> Move:
    """The node furthest above its capacity sends its biggest expert piece -- the whole of the expert's load at home,
    as far as another node's room and one rank's capacity allow (given ``chain_host``, the ``can_host`` mask, as far
    as the receiver can hold or pass on to one rank of its node) -- to the rank, on another node, that can take the
    most of it, then whose overflow above ``high`` its own biggest experts cover in the fewest pieces (each piece
    takes a slot of its node), then the least loaded: the pieces the per-node lower bound counts, so few clones
    cross nodes. The receiver may end above ``high``; its own experts then go to ranks of its node (the pass's
    intra-node moves), as the exact optimum's placements do. With ``roomiest_node_first`` the node with the most room
    is preferred above all: an import there leaves its node the most room to settle it (and the next imports) inside
    it, which with one spare slot a rank is sometimes what lets it pass the import on in few pieces."""
    node_excess = state.node_excess()
    worst, excess = torch.argmax(node_excess), node_excess.max()  # (indexing by a tensor would read it on the host)
    on_worst = state.nodes[state.home_rank] == worst  # [E]
    node_room = (-node_excess).clamp(min=0)  # [N]
    # what one receiver can take: its node's room, and no more than a rank's capacity
    reach = torch.minimum(node_room[state.nodes], state.high)  # [R]
    if chain_host is not None:
        reach = torch.minimum(reach, state.room() + _chain_reach(state, chain_host))
    piece = torch.where(on_worst & (excess > 0), state.home_load, 0)  # [E]: whole pieces, as the bound counts
    amount = torch.minimum(piece.unsqueeze(0), reach.unsqueeze(1))  # [R, E]
    valid = ((state.free > 0) & (state.nodes != worst)).unsqueeze(1) & ~state.has_clone & (amount > 0)
    keys = [amount, -_pieces_to_shed(state, state.load.unsqueeze(1) + amount - state.high),
            (state.high - state.load).view(-1, 1).expand_as(amount)]  # the biggest piece, fewest sheds, emptiest
    if roomiest_node_first:
        keys.insert(0, node_room[state.nodes].view(-1, 1).expand_as(amount))
    best = _lexicographic_first(valid, keys)
    receiver, expert = best // amount.shape[1], best % amount.shape[1]
    return expert, receiver, torch.where(valid.flatten()[best], amount.flatten()[best], 0)


def _pieces_to_shed(state: _PlanState, over: torch.Tensor) -> torch.Tensor:
    """``over[r, j]`` tokens above ``high`` on rank ``r``: how many of its home experts, biggest first, cover them
    (0 where nothing is over; ``experts_per_rank + 1`` where all of them do not)."""
    ranks, local = state.rank_ids.shape[0], state.experts_per_rank
    covered = state.home_load.view(ranks, local).sort(dim=1, descending=True).values.cumsum(dim=1)  # [R, l]
    return (covered.unsqueeze(1) < over.unsqueeze(2)).sum(dim=2) + (over > 0).to(torch.int64)


def _chain_reach(state: _PlanState, host: torch.Tensor) -> torch.Tensor:
    """``[R]``: the largest piece of one of its home experts a rank can pass on to one rank of its own node."""
    ranks, local = state.rank_ids.shape[0], state.experts_per_rank
    room = state.room()
    amount = torch.minimum(state.home_load.view(1, ranks, local), room.view(-1, 1, 1))  # [r2, r, l]
    valid = host & state.same_node.unsqueeze(2)
    return torch.where(valid, amount, 0).amax(dim=(0, 2))


def _chain_move(state: _PlanState, receiver: torch.Tensor) -> Move:
    """``receiver``'s overflow above ``high`` to one rank of its node (best fit); amount 0 when it has none."""
    local = state.experts_per_rank
    over = state.load[receiver] - state.high  # [1]
    home = state.home_load[receiver * local + torch.arange(local, device=over.device)]  # [l]
    room = state.room()
    host = state.can_host()[:, receiver] & state.same_node[:, receiver].view(-1, 1, 1)  # [r2, 1, l]
    valid = host & (home >= over).view(1, 1, -1) & (room >= over).view(-1, 1, 1) & (over > 0).view(1, 1, 1)
    best = _lexicographic_first(valid, [-room.view(-1, 1, 1).expand_as(valid)])  # best fit: the least room
    return receiver * local + best % local, best // local, torch.where(valid.flatten()[best], over, 0)


def _bin_covering_key(amount: torch.Tensor, need: torch.Tensor, room: torch.Tensor,
                      fits: torch.Tensor | None = None) -> torch.Tensor:
    """One int64 key, larger is better: the move takes the donor to ``high``; if not, its size; then (forced
    moves) whether it fits without a chain; then the least room left. Packed in bit fields, which holds while a
    step routes fewer than ``TOKEN_LIMIT`` (token, expert) pairs."""
    first = torch.where(amount >= need, TOKEN_LIMIT, amount)
    fits = torch.zeros_like(amount) if fits is None else fits.to(torch.int64)
    return (first * 2 + fits) * TOKEN_LIMIT + (TOKEN_LIMIT - 1 - (room - amount)).clamp(min=0)


def _lexicographic_first(valid: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
    """Flat index (1-element tensor) of the valid entry with the largest keys in order; the first on full ties."""
    chosen = valid
    for key in keys:
        masked = torch.where(chosen, key, torch.iinfo(torch.int64).min)
        chosen = chosen & (masked == masked.max())
    return torch.argmax(chosen.flatten().to(torch.int8)).view(1)


def _move_at(best: torch.Tensor, amount: torch.Tensor, valid: torch.Tensor, local: int) -> Move:
    """The ``[receiver, donor, l]`` entry ``best`` as a move; amount 0 when it is not valid."""
    block = amount.shape[1] * local
    receiver, expert = best // block, best % block
    return expert, receiver, torch.where(valid.flatten()[best], amount.flatten()[best], 0)


def _source_order(nodes: torch.Tensor) -> torch.Tensor:
    """Row ``r``: source ranks in the order a clone on ``r`` takes tokens from them: ``r``'s node first (fewer
    cross-node token copies), then by rank."""
    ranks = nodes.shape[0]
    other_node = (nodes.unsqueeze(1) != nodes.unsqueeze(0)).to(torch.int64)
    return torch.argsort(other_node * ranks + torch.arange(ranks, device=nodes.device), dim=1)


def _take_from_sources(available: torch.Tensor, amount: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``amount`` tokens out of ``available[s]``, taken from the sources in ``order`` (own node first)."""
    sorted_available = available[order]
    before = torch.cumsum(sorted_available, dim=0) - sorted_available
    sorted_take = torch.minimum((amount - before).clamp(min=0), sorted_available)
    return torch.zeros_like(available).scatter(0, order, sorted_take)
