"""The planner: enumerate layouts, keep those that fit memory, rank them by predicted step time.

For each buildable layout (:func:`~loongforge.planner.layouts.enumerate_layouts`) the cheapest recompute
that fits is chosen: none, then the selective module sets, then full recompute of as few layers per stage
as memory requires (found by bisection: memory falls and time rises with every recomputed layer). When the
search space lets it choose activation offload (``SearchSpace.choose_offload``), offloading the first k layers of
each stage is one more way to fit, next to each non-full recompute choice, with the smallest k that fits (bisection
again); at equal predicted time fewer offloaded layers win, so offload is chosen only where it is needed. Likewise,
when it may choose the chunked pipeline (``SearchSpace.chunk_counts``: ``parallel.seq_chunks: auto``), a layout
without cp, tp or vpp is tried with the fewest chunks that fit next to each non-full recompute choice, and with
the count that runs fastest (more chunks shrink the pipeline's bubble, each costs a forward). Layouts
that do not fit even with every layer recomputed are rejected and counted; when nothing fits, the plan
says how many devices (at this memory) or how much memory per device (at this count) would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.planner.hardware import ClusterSpec, format_bytes
from loongforge.planner.layouts import Candidate, RecomputePlan, SearchSpace, enumerate_layouts, recompute_choices
from loongforge.planner.memory import Coefficients, MemoryEstimate, Workload, estimate_memory
from loongforge.planner.timing import TimeCoefficients, TimeEstimate, estimate_time

#: Share of device memory the planner leaves free (allocator fragmentation, runtime, communication buffers).
DEFAULT_MARGIN = 0.10
#: How far the smallest-device-count search looks.
MAX_DEVICES = 1 << 16


@dataclass
class Evaluated:
    """A layout with its predicted peak memory and step time."""

    candidate: Candidate
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def pace(self) -> float:
        """What layouts are ranked by: step time (the global batch is fixed, so steps compare)."""
        return self.time.total

    def describe(self, workload: Workload) -> str:
        return self.candidate.describe(workload.terms().num_layers)


@dataclass(kw_only=True)
class PlanAnswer(ABC):
    """What the megatron :class:`Plan` and a task model's :class:`~loongforge.planner.task_planner.TaskPlan` answer
    alike: the ranked layouts that fit, the rejections, the memory budget, the best layout, and -- when nothing
    fits -- one line naming what would. A subclass adds what it planned for and says what did not fit
    (:meth:`what_failed`)."""

    cluster: ClusterSpec
    ranked: list[Any]
    rejected: Counter
    margin: float
    #: Layouts that missed the memory budget by the least (for the report).
    near_misses: list[Any] = field(default_factory=list)
    #: When nothing fits: the smallest device count at this memory / memory at this count that would.
    min_devices: int | None = None
    min_memory: float | None = None

    @property
    def budget(self) -> float:
        return self.cluster.device_memory * (1 - self.margin)

    @property
    def best(self) -> Any:
        if not self.ranked:
            raise ConfigError(self.infeasible_message())
        return self.ranked[0]

    #: What the report adds to a runner-up's relative pace ("" for step time).
    pace_unit: ClassVar[str] = ""

    @abstractmethod
    def what_failed(self) -> str:
        """The start of the infeasible line: which model no layout of it fits."""

    def infeasible_message(self) -> str:
        lines = [f"{self.what_failed()} fits {self.cluster.num_devices} device(s) of "
                 f"{format_bytes(self.cluster.device_memory)} (keeping {self.margin:.0%} free)"]
        if self.min_devices is not None:
            lines.append(f"smallest device count that works at {format_bytes(self.cluster.device_memory)}: "
                         f"{self.min_devices}")
        if self.min_memory is not None:
            lines.append(f"smallest memory per device that works with {self.cluster.num_devices} device(s): "
                         f"{format_bytes(self.min_memory)}")
        return "; ".join(lines)


@dataclass(kw_only=True)
class Plan(PlanAnswer):
    """The planner's answer for a megatron model: ranked layouts that fit, what was rejected and why."""

    workload: Workload

    def what_failed(self) -> str:
        return f"no layout of this {self.workload.terms().num_layers}-layer model"

    def decision(self) -> dict[str, Any]:
        """What ``parallel: auto`` records in the run's metadata: the layout, its predictions and the inputs."""
        best = self.best
        cand = best.candidate
        return {
            "layout": best.describe(self.workload),
            "parallel": cand.parallel_config(),
            "dp": cand.dp,
            "micro_batch_size": cand.micro_batch_size,
            "num_microbatches": cand.num_microbatches,
            "recompute": cand.recompute.as_config(),
            "offload_layers": sorted(cand.offloaded_layers(self.workload.terms().num_layers))
            if cand.offload_layers else None,
            "predicted_peak_bytes": int(best.memory.total),
            "predicted_memory_terms": {k: int(v) for k, v in best.memory.terms.items()},
            "predicted_step_seconds": best.time.total,
            "predicted_time_terms": best.time.terms,
            "devices": self.cluster.num_devices,
            "device_memory": self.cluster.device_memory,
            "ranks_per_node": self.cluster.ranks_per_node,
            "margin": self.margin,
            "considered": len(self.ranked) + sum(self.rejected.values()),
            "fitting": len(self.ranked),
            "rejected": dict(self.rejected),
        }


def _evaluate(workload: Workload, cand: Candidate, cluster: ClusterSpec, mem: Coefficients,
              tcoef: TimeCoefficients) -> Evaluated:
    return Evaluated(cand, estimate_memory(workload, cand, mem), estimate_time(workload, cand, cluster, tcoef))


def _rank_key(ev: Evaluated) -> tuple[float, int, int, float]:
    """Faster first; at equal time fewer offloaded layers (host traffic for nothing) and fewer chunks, then less
    memory."""
    return ev.time.total, ev.candidate.offload_layers, ev.candidate.seq_chunks, ev.memory.total


def _may_chunk(cand: Candidate, space: SearchSpace) -> bool:
    """Whether the planner may cut this layout's sequences into chunks: chunk counts to choose from, and a layout the
    chunked pipeline runs (cp=1, no vpp) whose memory the model has been measured to predict -- tp=1: beside tensor
    parallelism a chunked run measured twice the prediction (docs/long-context.md), so the planner does not offer it
    (a config may still set both)."""
    return len(space.chunk_counts) > 1 and cand.cp == 1 and cand.vpp == 1 and cand.tp == 1


def _fewest_that_fit(variant: Callable[[int], Evaluated], most: int, budget: float) -> Evaluated | None:
    """``variant(k)`` for the smallest k in 1..``most`` that fits ``budget`` (memory falls as k grows: bisection),
    or None when even ``most`` does not."""
    if most < 1 or variant(most).memory.total > budget:
        return None
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if variant(mid).memory.total <= budget:
            hi = mid
        else:
            lo = mid + 1
    return variant(lo)


def _chunked_variants(workload: Workload, partial: list[Evaluated], cluster: ClusterSpec, budget: float,
                      mem: Coefficients, tcoef: TimeCoefficients, counts: tuple[int, ...]) -> tuple[list, Evaluated]:
    """(chunked variants of each non-full recompute choice that fit -- the fewest chunks that do, and the count that
    runs fastest --, the most-chunked variant of the leanest choice) for a layout the chunked pipeline may take."""
    fitting = []
    for ev in partial:
        def chunked(index: int, c: Candidate = ev.candidate) -> Evaluated:
            return _evaluate(workload, replace(c, seq_chunks=counts[index]), cluster, mem, tcoef)

        fewest = _fewest_that_fit(chunked, len(counts) - 1, budget)
        if fewest is not None:
            fits = [chunked(i) for i in range(counts.index(fewest.candidate.seq_chunks), len(counts))]
            fitting += [fewest, min(fits, key=_rank_key)]
    leanest = min(partial, key=lambda ev: ev.memory.total).candidate
    return fitting, _evaluate(workload, replace(leanest, seq_chunks=counts[-1]), cluster, mem, tcoef)


def _cheapest_fitting(
    workload: Workload, cand: Candidate, cluster: ClusterSpec, budget: float, mem: Coefficients,
    tcoef: TimeCoefficients, space: SearchSpace,
) -> tuple[Evaluated | None, Evaluated]:
    """(fastest recompute/offload/chunking choice that fits or None, the smallest-memory variant) for one layout."""
    layers_per_chunk = workload.terms().num_layers // (cand.pp * cand.vpp)
    choices = recompute_choices(workload.model, layers_per_chunk)
    partial = [_evaluate(workload, replace(cand, recompute=c), cluster, mem, tcoef)
               for c in choices if c.granularity != "full"]
    fitting = [ev for ev in partial if ev.memory.total <= budget]
    if workload.offloaded_layers:  # activation offload does not combine with full recompute (train refuses it)
        fastest = min(fitting, key=_rank_key) if fitting else None
        return fastest, min(partial, key=lambda ev: ev.memory.total)
    variants = [ev for ev in partial]
    if _may_chunk(cand, space):
        chunked, most = _chunked_variants(workload, partial, cluster, budget, mem, tcoef, space.chunk_counts)
        fitting += chunked
        variants.append(most)
    if space.choose_offload:  # the first k layers of every chunk offloaded, next to each non-full recompute choice
        for ev in partial:
            offloaded = _fewest_that_fit(
                lambda k, c=ev.candidate: _evaluate(workload, replace(c, offload_layers=k), cluster, mem, tcoef),
                layers_per_chunk, budget)
            fitting += [offloaded] if offloaded is not None else []
        variants.append(_evaluate(workload, replace(cand, offload_layers=layers_per_chunk, recompute=min(
            partial, key=lambda ev: ev.memory.total).candidate.recompute), cluster, mem, tcoef))
    # full recompute of the first k layers of a chunk: the smallest k that fits
    smallest = _evaluate(workload, replace(cand, recompute=RecomputePlan("full", num_layers=layers_per_chunk)),
                         cluster, mem, tcoef)
    full = _fewest_that_fit(lambda k: _evaluate(workload, replace(cand, recompute=RecomputePlan("full", num_layers=k)),
                                                cluster, mem, tcoef), layers_per_chunk, budget)
    fitting += [full] if full is not None else []
    smallest = min([smallest, *variants], key=lambda ev: ev.memory.total)
    if not fitting:
        return None, smallest
    return min(fitting, key=_rank_key), smallest


def plan(
    workload: Workload,
    cluster: ClusterSpec,
    space: SearchSpace | None = None,
    *,
    memory_coefficients: Coefficients | None = None,
    time_coefficients: TimeCoefficients | None = None,
    margin: float = DEFAULT_MARGIN,
    search_minimum: bool = True,
) -> Plan:
    """Rank every layout of ``workload`` on ``cluster`` that fits in memory; see the module docstring."""
    space = space or SearchSpace()
    mem, tcoef = memory_coefficients or Coefficients(), time_coefficients or TimeCoefficients()
    budget = cluster.device_memory * (1 - margin)
    rejected: Counter = Counter()
    ranked, misses = [], []
    for cand in enumerate_layouts(workload.model, cluster.num_devices, workload.seq_length, cluster.node_size,
                                  space, rejected):
        best, smallest = _cheapest_fitting(workload, cand, cluster, budget, mem, tcoef, space)
        if best is None:
            ways = [" or offload"] if space.choose_offload else []
            ways += [" or chunks"] if len(space.chunk_counts) > 1 else []
            rejected["exceeds memory even with full recompute" + "".join(ways)] += 1
            misses.append(smallest)
        else:
            ranked.append(best)
    ranked.sort(key=_rank_key)
    misses.sort(key=lambda ev: ev.memory.total)
    result = Plan(workload=workload, cluster=cluster, ranked=ranked, rejected=rejected, margin=margin,
                  near_misses=misses[:3])
    if not ranked and search_minimum:
        if misses:
            result.min_memory = misses[0].memory.total / (1 - margin)
        result.min_devices = smallest_device_count(workload, cluster, space, mem, margin)
    return result


def _fits_somewhere(workload: Workload, cluster: ClusterSpec, space: SearchSpace, mem: Coefficients,
                    budget: float) -> bool:
    """Whether any layout fits with every layer recomputed or (when the planner may choose it) offloaded -- the
    least memory a layout can take."""
    for cand in enumerate_layouts(workload.model, cluster.num_devices, workload.seq_length, cluster.node_size,
                                  space, Counter()):
        layers_per_chunk = workload.terms().num_layers // (cand.pp * cand.vpp)
        leanest = [replace(cand, recompute=RecomputePlan("full", num_layers=layers_per_chunk))]
        leanest += [replace(cand, offload_layers=layers_per_chunk)] if space.choose_offload else []
        leanest += [replace(cand, seq_chunks=space.chunk_counts[-1])] if _may_chunk(cand, space) else []
        if any(estimate_memory(workload, lean, mem).total <= budget for lean in leanest):
            return True
    return False


def smallest_device_count(
    workload: Workload, cluster: ClusterSpec, space: SearchSpace, mem: Coefficients, margin: float
) -> int | None:
    """The fewest devices (of this memory) on which some layout fits, or None below :data:`MAX_DEVICES`.

    Every count up to 1024 is tried (divisibility makes feasibility jump around), then powers of two.
    """
    budget = cluster.device_memory * (1 - margin)
    counts = [n for n in range(cluster.num_devices + 1, 1025)]
    counts += [1 << k for k in range(11, MAX_DEVICES.bit_length()) if 1 << k > cluster.num_devices]
    for n in counts:
        if _fits_somewhere(workload, cluster.with_(num_devices=n), space, mem, budget):
            return n
    return None
