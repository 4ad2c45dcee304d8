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
- topology aware: a clone on another node costs a weight transfer over the slower link, so the tokens a receiver on
  another node would relieve count ``1 - topology_weight`` times (a receiver in the donor's node is preferred unless
  it relieves that much less), and a clone takes its tokens first from source ranks on its own node (fewer cross-node
  token copies). Clones across nodes carry at most what the donor's node holds above its share of the load (node-level
  imbalance); imbalance inside a node is fixed inside it. A discount relative to the move, rather than a fixed token
  penalty, keeps the preference meaningful as the mean load per rank shrinks with more ranks: with one spare slot per
  rank at 32-64 ranks a fixed penalty wastes slots on small intra-node moves and loses balance.

Greedy water-filling: repeatedly take the most loaded rank, and among (its home expert, receiver with a free slot)
pairs the one that moves the most tokens, where a move never takes the donor below the mean load nor the receiver
above the mean plus ``RECEIVER_SLACK``. ``topology_weight=0`` with ``ranks_per_node=num_ranks`` is the topology-blind
planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Receivers may be filled up to this fraction above the mean (donors shed down to the mean). With one spare
#: slot a receiver takes one expert's tokens, so rooms rarely add up exactly to a donor's excess; exact
#: filling strands the remainders and leaves donors at 1.1-1.2x the mean, while 5% headroom absorbs them.
RECEIVER_SLACK = 0.05


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
    device = counts.device
    nodes = node_of(ranks, ranks_per_node, device)
    rank_ids = torch.arange(ranks, device=device)
    node_size = torch.zeros(-(-ranks // ranks_per_node), dtype=torch.int64, device=device).index_add_(
        0, nodes, torch.ones_like(nodes))
    slots = ranks * spare_slots

    keep = counts.clone()
    home_load = counts.sum(dim=0)  # tokens still at each expert's home instance
    load = home_load.view(ranks, experts_per_rank).sum(dim=1)
    target = (load.sum() + ranks - 1) // ranks  # the mean, rounded up: donors shed down to it
    high = target + (target.to(torch.float64) * RECEIVER_SLACK).to(torch.int64)
    scale = 1 << 10
    discount = min(int(round(topology_weight * scale)), scale - 1)  # inter-node moves still rank by size
    free = torch.full((ranks,), spare_slots, dtype=torch.int64, device=device)
    has_clone = torch.zeros(ranks, experts, dtype=torch.bool, device=device)
    slot_expert = torch.full((slots,), -1, dtype=torch.int64, device=device)
    slot_take = torch.zeros(slots, ranks, dtype=torch.int64, device=device)
    local = torch.arange(experts_per_rank, device=device)

    # Indices stay 1-element tensors: indexing with a 0-d tensor would call ``.item()`` (a device sync).
    for _ in range(slots):
        donor = torch.argmax(load).view(1)
        donor_experts = donor * experts_per_rank + local  # [L]
        excess = (load[donor] - target).clamp(min=0)  # [1]
        room = (high - load).clamp(min=0)  # [R]
        movable = torch.minimum(home_load[donor_experts].unsqueeze(1), torch.minimum(excess, room).unsqueeze(0))
        eligible = ((free > 0) & (rank_ids != donor)).unsqueeze(0) & ~has_clone[:, donor_experts].t()  # [L, R]
        movable = torch.where(eligible, movable, 0)
        # Across nodes, move only what the donor's node holds above its share: the rest is fixed inside it.
        remote = nodes != nodes[donor]  # [R]
        node_load = torch.zeros_like(node_size).index_add_(0, nodes, load)
        node_excess = (node_load - node_size * target).clamp(min=0)[nodes[donor]]  # [1]
        movable = torch.where(remote.unsqueeze(0), torch.minimum(movable, node_excess), movable)
        worth = scale - discount * remote.to(torch.int64)  # [R]: inter-node moves count less
        score = torch.where(movable > 0, movable * worth, -1).flatten()
        best = torch.argmax(score).view(1)
        expert = donor * experts_per_rank + best // ranks
        receiver = best % ranks
        amount = movable.flatten()[best]
        used = amount > 0

        take = _take_from_sources(keep[:, expert].squeeze(1), amount, nodes, nodes[receiver], ranks)
        slot = receiver * spare_slots + (spare_slots - free[receiver]).clamp(max=spare_slots - 1)
        slot_expert[slot] = torch.where(used, expert, slot_expert[slot])
        slot_take[slot] = torch.where(used.unsqueeze(1), take.unsqueeze(0), slot_take[slot])
        keep.index_add_(1, expert, -take.unsqueeze(1))
        home_load.index_add_(0, expert, -amount)
        load.index_add_(0, torch.cat([donor, receiver]), torch.cat([-amount, amount]))
        free.index_add_(0, receiver, -used.to(torch.int64))
        has_clone[receiver, expert] = has_clone[receiver, expert] | used
    return ReplicaPlan(slot_expert, slot_take, keep, experts_per_rank, spare_slots)


def _take_from_sources(available: torch.Tensor, amount: torch.Tensor, nodes: torch.Tensor, node: torch.Tensor,
                       ranks: int) -> torch.Tensor:
    """``amount`` tokens out of ``available[s]``, taken from sources on ``node`` first, then by rank order."""
    order = torch.argsort((nodes != node).to(torch.int64) * ranks + torch.arange(ranks, device=nodes.device))
    sorted_available = available[order]
    before = torch.cumsum(sorted_available, dim=0) - sorted_available
    sorted_take = torch.minimum((amount - before).clamp(min=0), sorted_available)
    return torch.zeros_like(available).scatter(0, order, sorted_take)
