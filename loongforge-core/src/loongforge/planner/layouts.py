"""Candidate layouts: the parallel sizes, micro-batch and recompute choice the planner compares.

:func:`enumerate_layouts` yields every layout megatron can build for a model on ``N`` devices -- tensor
parallel within a node and dividing the heads and query groups, pipeline stages dividing the layers,
context parallel dividing the heads per tensor rank and the sequence, expert parallel dividing the experts
-- and counts the combinations it skipped by reason, so that ``loongforge plan`` can say why a layout the
user expected is absent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: Selective recompute choices tried, cheapest first (megatron module names, see models/recompute.py).
SELECTIVE_CHOICES_DENSE: tuple[tuple[str, ...], ...] = (("core_attn",), ("mlp",), ("core_attn", "mlp"))
SELECTIVE_CHOICES_MOE: tuple[tuple[str, ...], ...] = (("core_attn",), ("moe",), ("core_attn", "moe"))


@dataclass(frozen=True)
class RecomputePlan:
    """Activation recompute for every pipeline stage.

    ``none``; ``selective`` re-runs ``modules`` of every layer; ``full`` re-runs whole layers: the first
    ``num_layers`` layers of each stage (megatron's ``block`` method), the others keep their activations.
    """

    granularity: str = "none"
    modules: tuple[str, ...] = ()
    num_layers: int = 0

    def describe(self, layers_per_stage: int) -> str:
        if self.granularity == "selective":
            return f"selective({'+'.join(self.modules)})"
        if self.granularity == "full":
            return "full" if self.num_layers >= layers_per_stage else f"full({self.num_layers}/{layers_per_stage})"
        return "none"

    def as_config(self) -> dict[str, Any] | None:
        """The ``model.recompute`` mapping (None: no recompute)."""
        if self.granularity == "selective":
            return {"granularity": "selective", "modules": list(self.modules)}
        if self.granularity == "full":
            return {"granularity": "full", "method": "block", "num_layers": self.num_layers}
        return None


@dataclass(frozen=True)
class Candidate:
    """One layout for one world size: parallel sizes, batch cut and recompute."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    micro_batch_size: int = 1
    num_microbatches: int = 1
    recompute: RecomputePlan = field(default_factory=RecomputePlan)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self, num_layers: int) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp != self.tp else []
        parts += [f"dp{self.dp}", f"mbs{self.micro_batch_size}x{self.num_microbatches}"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["distopt"] if self.distributed_optimizer else []
        parts += [f"rc:{self.recompute.describe(num_layers // (self.pp * self.vpp))}"]
        return " ".join(parts)

    def parallel_config(self) -> dict[str, Any]:
        """The ``parallel`` config mapping for this layout (``dp`` follows from the world size)."""
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp if self.vpp > 1 else None, "cp": self.cp,
                "ep": self.ep, "etp": self.etp, "sequence_parallel": self.sequence_parallel,
                "distributed_optimizer": self.distributed_optimizer}


@dataclass(frozen=True)
class SearchSpace:
    """What the enumeration may vary; a fixed field narrows the search (``None``: let the planner choose)."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    #: Fixed micro-batch size (the config's, when it gives no global batch size to cut differently).
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    max_cp: int = 8
    try_vpp: bool = True
    #: Whether layouts without the distributed optimizer are compared too (it never costs time in the model).
    allow_plain_optimizer: bool = False
    tp_across_nodes: bool = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_choices(flavor: Any, layers_per_stage: int) -> list[RecomputePlan]:
    """No recompute, the selective module sets, then full recompute of 1..all layers of a stage."""
    selective = SELECTIVE_CHOICES_MOE if flavor.num_experts else SELECTIVE_CHOICES_DENSE
    plans = [RecomputePlan()]
    plans += [RecomputePlan("selective", modules) for modules in selective]
    plans += [RecomputePlan("full", num_layers=k) for k in range(1, layers_per_stage + 1)]
    return plans


def enumerate_layouts(
    flavor: Any, num_devices: int, seq_length: int, ranks_per_node: int, space: SearchSpace, rejected: Counter
) -> Iterator[Candidate]:
    """Every buildable layout of ``flavor`` on ``num_devices`` (recompute left at none; the planner adds it).

    ``rejected`` counts skipped combinations by reason (a parallel split that does not divide, a batch that
    does not cut evenly).
    """
    heads, groups, layers = flavor.num_attention_heads, flavor.num_query_groups, flavor.num_layers
    experts = flavor.num_experts
    for tp in _divisors(num_devices):
        if tp > ranks_per_node and not space.tp_across_nodes:
            rejected["tp larger than a node"] += 1
            continue
        if heads % tp or groups % tp:
            rejected["tp does not divide heads/query groups"] += 1
            continue
        for pp in _divisors(num_devices // tp):
            if layers % pp:
                rejected["pp does not divide layers"] += 1
                continue
            for cp in _divisors(num_devices // (tp * pp)):
                if cp > space.max_cp:
                    continue
                if cp > 1 and flavor.context_parallel_blocker is not None:
                    rejected[f"cp with {flavor.context_parallel_blocker}"] += 1
                    continue
                if cp > 1 and (heads % (tp * cp) or groups % (tp * cp) or seq_length % (2 * cp * tp)):
                    rejected["cp does not divide heads per tp rank or the sequence"] += 1
                    continue
                dp = num_devices // (tp * pp * cp)
                yield from _experts_and_batches(flavor, tp, pp, cp, dp, space, rejected, experts)


def _experts_and_batches(
    flavor: Any, tp: int, pp: int, cp: int, dp: int, space: SearchSpace, rejected: Counter, experts: int | None
) -> Iterator[Candidate]:
    expert_choices = [(1, tp)]
    if experts:
        expert_choices = []
        for ep in _divisors(experts):
            for etp in sorted({1, tp}):
                if (tp * cp * dp) % (ep * etp) or flavor.moe_ffn_hidden_size % etp:
                    rejected["ep*etp does not divide the ranks of a stage or experts"] += 1
                    continue
                expert_choices.append((ep, etp))
    sp_choices = (True,) if tp > 1 else (False,)
    vpp_choices = [1] + ([v for v in (2, 4, 5, 8) if pp > 1 and flavor.num_layers % (pp * v) == 0]
                         if space.try_vpp else [])
    # The distributed optimizer is offered only where there are data-parallel replicas to shard over (dp > 1). At
    # dp=1 -- one process, or context parallelism alone -- a chosen layout keeps the plain optimizer: sharding over
    # the context-parallel ranks alone is left to an explicit ``parallel.distributed_optimizer: true``.
    dist_opt = (False,) if dp == 1 else (True, False) if space.allow_plain_optimizer else (True,)
    for ep, etp in expert_choices:
        for mbs, num_micro in _batch_cuts(dp, space, rejected):
            for vpp in vpp_choices:
                if vpp > 1 and num_micro % pp:
                    rejected["vpp needs micro-batches divisible by pp"] += 1
                    continue
                for sp in sp_choices:
                    for distopt in dist_opt:
                        yield Candidate(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, sequence_parallel=sp,
                                        distributed_optimizer=distopt, micro_batch_size=mbs,
                                        num_microbatches=num_micro)


def _batch_cuts(dp: int, space: SearchSpace, rejected: Counter) -> Iterator[tuple[int, int]]:
    """(micro-batch size, micro-batches per step) pairs that cut the global batch evenly over ``dp``."""
    if space.global_batch_size is None:
        for mbs in (space.micro_batch_size,) if space.micro_batch_size else space.micro_batch_sizes:
            yield mbs, 1
        return
    if space.global_batch_size % dp:
        rejected["global batch does not divide over dp"] += 1
        return
    per_rank = space.global_batch_size // dp
    sizes = (space.micro_batch_size,) if space.micro_batch_size else space.micro_batch_sizes
    for mbs in sizes:
        if per_rank % mbs:
            rejected["micro-batch does not divide the per-rank batch"] += 1
            continue
        yield mbs, per_rank // mbs
