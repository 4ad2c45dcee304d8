"""TAOT expert-replica placement against three baselines, on simulated skewed MoE loads (CPU, < 2 minutes).

    python benchmarks/taot_placement.py [--steps 12] [--seeds 3]
    python benchmarks/taot_placement.py --reference --steps 4   # vs the MILP (the test's 4 loads), minutes
    python benchmarks/taot_placement.py --reference --steps 4 --spare-slots 2

Per (ranks R, spare slots K): 128 experts, 4096 tokens x top-8 per rank, 8 ranks per node, popularity from
``loongforge_balance.taot.synthetic`` (log-normal, drifting each step). Planners:

- ``none``: no replication, every token goes to its expert's home rank;
- ``eplb``: DeepSeek-EPLB-style static replication recomputed every ``--eplb-interval`` steps from the load
  history (replica counts by greedy "most load per replica", replicas packed heaviest-first onto the least
  loaded rank with a free slot; tokens spread evenly over an expert's instances);
- ``blind``: the per-step greedy planner with topology weight 0 (the whole world seen as one node);
- ``taot``: the per-step topology-aware planner (default topology weight).

Columns: max/mean rank load (mean over steps), inter-node clone weight bytes per step (bf16 SwiGLU expert of
hidden 2048 x 768, Qwen3-30B-A3B sized), cross-node (token, expert) copies per step, planner latency (median
ms per step, this CPU). Then taot's ratios vs ``blind``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from loongforge_balance.taot import ReplicaPlan, plan_costs, plan_replicas
from loongforge_balance.taot.layer import ReplicaSettings
from loongforge_balance.taot.synthetic import skewed_counts
from taot_reference import milp_fewest_inter_node_clones, per_node_lower_bound

EXPERTS, RANKS_PER_NODE = 128, 8
EXPERT_BYTES = 3 * 2048 * 768 * 2  # gate, up, down projections in bf16
CONFIGS = [(16, 1), (32, 1), (64, 1), (16, 2), (32, 2), (64, 2)]


def eplb_replicas(history: torch.Tensor, ranks: int, spare_slots: int) -> torch.Tensor:
    """Static replica placement from ``history[e]`` (tokens per expert): slot -> expert, -1 when empty."""
    local = EXPERTS // ranks
    replicas = torch.ones(EXPERTS, dtype=torch.int64)
    for _ in range(ranks * spare_slots):  # each spare slot goes to the expert with the most load per replica
        replicas[torch.argmax(history / replicas)] += 1
    rank_load = (history / replicas).view(ranks, local).sum(1)
    slot_expert = torch.full((ranks * spare_slots,), -1, dtype=torch.int64)
    free = torch.full((ranks,), spare_slots)
    extra = [(float(history[e] / replicas[e]), e) for e in range(EXPERTS) for _ in range(int(replicas[e]) - 1)]
    for share, expert in sorted(extra, reverse=True):  # heaviest replica to the least loaded rank that can host it
        candidates = [r for r in range(ranks) if free[r] > 0 and r != expert // local
                      and expert not in {int(x) for x in slot_expert[r * spare_slots:(r + 1) * spare_slots]}]
        if not candidates:
            continue
        rank = min(candidates, key=lambda r: (float(rank_load[r]), r))
        slot_expert[rank * spare_slots + spare_slots - int(free[rank])] = expert
        free[rank] -= 1
        rank_load[rank] += share
    return slot_expert


def eplb_plan(counts: torch.Tensor, slot_expert: torch.Tensor, spare_slots: int) -> ReplicaPlan:
    """This step's tokens spread evenly over each expert's home and replicas (source by source)."""
    ranks = counts.shape[0]
    instances = 1 + torch.bincount(slot_expert[slot_expert >= 0], minlength=EXPERTS)
    share = counts // instances
    home_keep = counts - share * (instances - 1)
    slot_take = torch.zeros(ranks * spare_slots, ranks, dtype=torch.int64)
    used = slot_expert >= 0
    slot_take[used] = share[:, slot_expert[used]].t()
    return ReplicaPlan(slot_expert, slot_take, home_keep, EXPERTS // ranks, spare_slots)


def run(ranks: int, spare_slots: int, loads: list[torch.Tensor], eplb_interval: int, weight: float) -> dict:
    rows = {name: {"balance": [], "bytes": [], "tokens": [], "ms": []} for name in ("none", "eplb", "blind", "taot")}
    local = EXPERTS // ranks
    planners = {
        "none": lambda c: plan_replicas(c, experts_per_rank=local, spare_slots=0, ranks_per_node=RANKS_PER_NODE,
                                        topology_weight=0.0),
        "blind": lambda c: plan_replicas(c, experts_per_rank=local, spare_slots=spare_slots, ranks_per_node=ranks,
                                         topology_weight=0.0),
        "taot": lambda c: plan_replicas(c, experts_per_rank=local, spare_slots=spare_slots,
                                        ranks_per_node=RANKS_PER_NODE, topology_weight=weight),
    }
    for steps in loads:
        history = torch.zeros(EXPERTS, dtype=torch.float64)
        placement = None
        for step, full in enumerate(steps):
            counts = full[:ranks]
            for name, planner in planners.items():
                start = time.perf_counter()
                plan = planner(counts)
                rows[name]["ms"].append((time.perf_counter() - start) * 1e3)
                _record(rows[name], plan)
            if placement is None or step % eplb_interval == 0:  # recomputed from the steps seen so far
                start = time.perf_counter()
                placement = eplb_replicas(history if step else counts.sum(0).double(), ranks, spare_slots)
                rows["eplb"]["ms"].append((time.perf_counter() - start) * 1e3)
            _record(rows["eplb"], eplb_plan(counts, placement, spare_slots))
            history = 0.9 * history + counts.sum(0).double()
    return {name: {key: (statistics.median(v) if key == "ms" else statistics.fmean(v)) for key, v in row.items()}
            for name, row in rows.items()}


def _record(row: dict, plan: ReplicaPlan) -> None:
    costs = plan_costs(plan, RANKS_PER_NODE)
    row["balance"].append(costs.max_over_mean)
    row["bytes"].append(costs.inter_node_bytes(EXPERT_BYTES))
    row["tokens"].append(costs.cross_node_tokens)


def reference_table(loads: list[torch.Tensor], node_limit: int, spare_slots: int) -> None:
    """Full-weight inter-node clones per load vs the independent references (``taot_reference``): the MILP's best
    placement (exports from full nodes only), its bound, and the per-node lower bound; K spare slots, steps 0, 3, 6,
    9."""
    print(f"K = {spare_slots} spare slot(s) per rank")
    print(f"{'R':>3} {'load':>5} {'taot w=1':>9} {'MILP placement':>15} {'MILP bound':>11} {'node bound':>11}")
    for ranks in (16, 32, 64):
        local, totals = EXPERTS // ranks, [0, 0, 0, 0]
        for index, counts in enumerate(torch.cat(loads)[0::3][:4]):
            counts = counts[:ranks]
            ours = plan_costs(plan_replicas(counts, experts_per_rank=local, spare_slots=spare_slots,
                                            ranks_per_node=RANKS_PER_NODE, topology_weight=1.0),
                              RANKS_PER_NODE).inter_node_clones
            expert_load = counts.sum(0).tolist()
            milp = milp_fewest_inter_node_clones(expert_load, RANKS_PER_NODE, local, spare_slots,
                                                 full_nodes_export_only=True, node_limit=node_limit)
            row = [ours, milp.clones, milp.bound, per_node_lower_bound(expert_load, RANKS_PER_NODE, local)]
            totals = [t + (v or 0) for t, v in zip(totals, row, strict=True)]
            print(f"{ranks:>3} {index:>5} {row[0]:>9} {row[1]!s:>15} {row[2]:>11} {row[3]:>11}", flush=True)
        ours, placed, _, bound = totals
        print(f"{ranks:>3} {'sum':>5} {ours:>9} {placed:>15} {totals[2]:>11} {bound:>11}   "
              f"taot / MILP placement x{ours / max(placed, 1):.2f}, / node bound x{ours / max(bound, 1):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eplb-interval", type=int, default=10)
    parser.add_argument("--topology-weight", type=float, default=ReplicaSettings().topology_weight)
    parser.add_argument("--reference", action="store_true", help="compare with the MILP reference instead")
    parser.add_argument("--reference-node-limit", type=int, default=2000)
    parser.add_argument("--spare-slots", type=int, default=1, help="K of the --reference table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loads = [skewed_counts(args.steps, 64, EXPERTS, seed=seed) for seed in range(args.seeds)]
    if args.reference:
        reference_table(loads, args.reference_node_limit, args.spare_slots)
        return
    print(f"{EXPERTS} experts, 4096 tokens x top-8 per rank, {RANKS_PER_NODE} ranks/node, {args.steps} steps x "
          f"{args.seeds} seeds, EPLB every {args.eplb_interval} steps, topology weight {args.topology_weight}")
    print(f"{'R':>3} {'K':>2} {'planner':>7} {'max/mean':>9} {'inter-node MB/step':>19} "
          f"{'x-node tokens/step':>19} {'plan ms':>8}")
    for ranks, spare_slots in CONFIGS:
        result = run(ranks, spare_slots, loads, args.eplb_interval, args.topology_weight)
        for name, row in result.items():
            print(f"{ranks:>3} {spare_slots:>2} {name:>7} {row['balance']:>9.3f} {row['bytes'] / 2**20:>19.1f} "
                  f"{row['tokens']:>19.0f} {row['ms']:>8.2f}")
        ours, blind = result["taot"], result["blind"]
        print(f"{'':>14}taot vs blind: inter-node bytes x{ours['bytes'] / max(blind['bytes'], 1):.2f}, "
              f"cross-node tokens x{ours['tokens'] / blind['tokens']:.3f}, "
              f"max/mean {ours['balance']:.3f} vs {blind['balance']:.3f}")


if __name__ == "__main__":
    main()
