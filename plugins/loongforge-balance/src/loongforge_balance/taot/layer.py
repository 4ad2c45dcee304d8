"""Expert-parallel SwiGLU experts with this step's clones: plan, send weights and tokens, compute, combine.

Every step: all-gather the per-rank expert counts, plan (every rank computes the same plan), send each clone's
weights from its home rank to the clone's rank, send every (token, expert) pair to the instance the plan
chose, run each instance's SwiGLU on its tokens, send the outputs back and sum them weighted by the router
probabilities. All transfers are autograd-aware all-to-alls (functional collectives), so the
backward pass returns each clone's weight gradient to its home rank, where it accumulates into the home
expert's gradient like the gradient of any other use of the parameter.

Host synchronisation: the planner needs none; the all-to-alls need their split sizes on the host (gloo and
NCCL take Python lists), which costs one device-to-host copy of a small int tensor per call, as in megatron's
own all-to-all token dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from loongforge_balance.taot.planner import ReplicaPlan, plan_replicas


@dataclass(frozen=True)
class ReplicaSettings:
    """How the clones are planned: ``spare_slots`` per rank, topology weight, ranks per node."""

    spare_slots: int = 1
    topology_weight: float = 0.5
    ranks_per_node: int = 8


def swiglu(tokens: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """Megatron's gated expert MLP: ``fc1`` is ``[gate; up]`` stacked on dim 0, ``fc2`` projects back."""
    gate, up = torch.chunk(F.linear(tokens, fc1), 2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2)


def replicated_experts(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    settings: ReplicaSettings,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, ReplicaPlan]:
    """``sum_e probs[t, e] * expert_e(tokens[t])`` over the routed experts of every local token.

    :param tokens: ``[T, H]`` this rank's tokens.
    :param probs: ``[T, E]`` router weights (only entries where ``routing_map`` is set are used).
    :param routing_map: ``[T, E]`` bool, the experts each token is routed to.
    :param fc1: ``[L, 2F, H]`` this rank's home experts' gate/up weights (expert ``rank * L + i`` is row ``i``).
    :param fc2: ``[L, H, F]`` their down projections.
    :return: the ``[T, H]`` output and the plan it used.
    """
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    local = fc1.shape[0]
    counts = _all_gather_counts(routing_map.sum(dim=0).to(torch.int64), ranks, group)
    plan = plan_replicas(counts, experts_per_rank=local, spare_slots=settings.spare_slots,
                         ranks_per_node=settings.ranks_per_node, topology_weight=settings.topology_weight)
    route = _Route(plan, routing_map, me)
    sizes = route.host_sizes()

    clone_fc1, clone_fc2 = _fetch_clone_weights(plan, fc1, fc2, me, sizes, group)
    received = _exchange(tokens[route.token_of_pair[route.send_order]], sizes.recv_tokens, sizes.send_tokens, group)
    by_instance = received[route.instance_order]
    # Every instance runs, even without tokens (an empty matmul): each rank's backward must then reach every
    # all-to-all of the forward, or the ranks would disagree on the collectives they call and hang.
    outputs = []
    for instance, chunk in enumerate(torch.split(by_instance, sizes.instance_tokens)):
        if instance < local:
            outputs.append(swiglu(chunk, fc1[instance], fc2[instance]))
        else:
            outputs.append(swiglu(chunk, clone_fc1[instance - local], clone_fc2[instance - local]))
    computed = torch.cat(outputs)
    returned = _exchange(computed[route.instance_order_inverse], sizes.send_tokens, sizes.recv_tokens, group)
    pair_output = returned[route.send_order_inverse]
    weights = probs[route.token_of_pair, route.expert_of_pair].unsqueeze(1).to(pair_output.dtype)
    out = torch.zeros(tokens.shape[0], fc2.shape[1], dtype=pair_output.dtype, device=tokens.device)
    return out.index_add(0, route.token_of_pair, pair_output * weights), plan


def _all_gather_counts(local_counts: torch.Tensor, ranks: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    gathered = [torch.empty_like(local_counts) for _ in range(ranks)]
    dist.all_gather(gathered, local_counts, group=group)
    return torch.stack(gathered)


def _exchange(send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of rows (the backward sends the gradients the other way)."""
    received = funcol.all_to_all_single(send.contiguous(), recv_sizes, send_sizes, group or dist.group.WORLD)
    return funcol.wait_tensor(received)


@dataclass(frozen=True)
class _HostSizes:
    send_tokens: list[int]  # rows to each destination rank
    recv_tokens: list[int]  # rows from each source rank
    instance_tokens: list[int]  # rows per local instance (home experts, then spare slots)
    send_weights: list[int]  # clone weights to each rank (this rank as home)
    recv_weights: list[int]  # clone weights from each home rank (for this rank's slots)


class _Route:
    """Where each of this rank's (token, expert) pairs goes, and how received rows group into instances."""

    def __init__(self, plan: ReplicaPlan, routing_map: torch.Tensor, me: int) -> None:
        self.plan, self.me = plan, me
        ranks, local, spare = plan.num_ranks, plan.experts_per_rank, plan.spare_slots
        per_rank = local + spare
        device = routing_map.device
        # Pairs in (expert, token) order; the plan's entries for this source in the same expert order.
        self.expert_of_pair, self.token_of_pair = routing_map.t().nonzero(as_tuple=True)
        experts = plan.home_keep.shape[1]
        slot_ids = torch.arange(ranks * spare, device=device)
        entry_expert = torch.cat([torch.arange(experts, device=device), plan.slot_expert.clamp(min=0)])
        entry_rank_in_expert = torch.cat([torch.zeros(experts, dtype=torch.int64, device=device), slot_ids + 1])
        entry_instance = torch.cat([
            (torch.arange(experts, device=device) // local) * per_rank + torch.arange(experts, device=device) % local,
            (slot_ids // max(spare, 1)) * per_rank + local + slot_ids % max(spare, 1),
        ])
        entry_count = torch.cat([plan.home_keep[me], plan.slot_take[:, me]])
        order = torch.argsort(entry_expert * (ranks * spare + 1) + entry_rank_in_expert)
        pair_instance = torch.repeat_interleave(entry_instance[order], entry_count[order],
                                                output_size=self.expert_of_pair.shape[0])
        self.send_order = torch.argsort(pair_instance, stable=True)
        self.send_order_inverse = torch.argsort(self.send_order)
        # Received rows come source by source, each source's rows instance by instance; regroup by instance.
        self.incoming = plan.flow()[:, me, :]  # [source, instance]
        row_instance = torch.repeat_interleave(torch.arange(per_rank, device=device).repeat(ranks),
                                               self.incoming.flatten())
        self.instance_order = torch.argsort(row_instance, stable=True)
        self.instance_order_inverse = torch.argsort(self.instance_order)

    def host_sizes(self) -> _HostSizes:
        """Every split size the collectives need, in one device-to-host copy."""
        plan, me, ranks = self.plan, self.me, self.plan.num_ranks
        spare = plan.spare_slots
        flow = plan.flow()
        clone_rank = torch.arange(ranks * spare, device=flow.device) // max(spare, 1)
        home_rank = plan.slot_expert // plan.experts_per_rank
        mine = (plan.slot_expert >= 0) & (home_rank == me)
        send_weights = torch.zeros(ranks, dtype=torch.int64, device=flow.device).index_add(
            0, clone_rank, mine.to(torch.int64))
        here = (plan.slot_expert >= 0) & (clone_rank == me)
        recv_weights = torch.zeros(ranks, dtype=torch.int64, device=flow.device).index_add(
            0, home_rank.clamp(min=0), here.to(torch.int64))
        packed = torch.cat([flow[me].sum(dim=1), self.incoming.sum(dim=1), self.incoming.sum(dim=0),
                            send_weights, recv_weights]).tolist()
        per_rank = plan.experts_per_rank + spare
        cuts = [ranks, 2 * ranks, 2 * ranks + per_rank, 3 * ranks + per_rank]
        return _HostSizes(packed[:cuts[0]], packed[cuts[0]:cuts[1]], packed[cuts[1]:cuts[2]],
                          packed[cuts[2]:cuts[3]], packed[cuts[3]:])


def _fetch_clone_weights(plan: ReplicaPlan, fc1: torch.Tensor, fc2: torch.Tensor, me: int, sizes: _HostSizes,
                         group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of this rank's spare slots, ``[K, 2F, H]`` and ``[K, H, F]`` (zeros for empty slots).

    Home ranks send the experts cloned elsewhere, ordered by slot; slots receive them ordered by home rank.
    """
    local, spare = plan.experts_per_rank, plan.spare_slots
    ranks = plan.num_ranks
    device = fc1.device
    flat = torch.cat([fc1.flatten(1), fc2.flatten(1)], dim=1)  # [L, 2FH + HF]
    slot_ids = torch.arange(ranks * spare, device=device)
    home_rank = plan.slot_expert // local
    used = plan.slot_expert >= 0
    # Sending: my experts cloned anywhere, in slot order (slot order is destination-rank order).
    sent_slots = slot_ids[used & (home_rank == me)]
    send = flat[plan.slot_expert[sent_slots] - me * local]
    # Receiving: my slots that hold an expert, ordered by their home rank (then slot).
    my_slots = slot_ids[me * spare:(me + 1) * spare]
    held = my_slots[used[my_slots]]
    held = held[torch.argsort(home_rank[held], stable=True)]
    received = _exchange(send, sizes.recv_weights, sizes.send_weights, group)
    slots = flat.new_zeros(spare, flat.shape[1]).index_copy(0, held - me * spare, received)
    split = fc1[0].numel()
    return slots[:, :split].view(spare, *fc1.shape[1:]), slots[:, split:].view(spare, *fc2.shape[1:])
