"""Candidate layouts: the parallel sizes, micro-batch and recompute choice the planner compares.

:func:`enumerate_layouts` yields every layout megatron can build for a model on ``N`` devices -- tensor
parallel within a node, context parallel dividing the sequence, expert parallel dividing the experts, and
whatever else the model family's own pre-flight (:meth:`~loongforge.models.family.ModelFamily.check_layout`:
for core's decoder, heads and query groups over tp and tp*cp, layers over pp*vpp, the expert width over etp)
asks -- and counts the combinations it skipped by reason, so that ``loongforge plan`` can say why a layout the
user expected is absent. ``loongforge check`` and ``train`` ask the same slot, so the planner never proposes a
layout they refuse.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.sizing import SELECTIVE_CHOICES_DENSE, SELECTIVE_CHOICES_MOE, DecoderTerms
from loongforge.parallel.megatron import Layout

__all__ = ["SELECTIVE_CHOICES_DENSE", "SELECTIVE_CHOICES_MOE", "Candidate", "RecomputePlan", "SearchSpace",
           "decoder_terms", "enumerate_layouts", "layout_problem", "recompute_choices"]

#: Why a combination is skipped when expert parallelism does not fit the ranks of a stage.
EXPERT_RANKS = "ep*etp does not divide the ranks of a stage or experts"


@functools.lru_cache(maxsize=256)
def _cached_terms(model: Any, kernels: str) -> DecoderTerms | None:
    return model.decoder_terms(kernels)


def decoder_terms(model: Any, kernels: str = "te") -> DecoderTerms:
    """``model.decoder_terms(kernels)`` (cached for hashable families: the planner asks for every layout), or a
    one-line :class:`ConfigError` when the family states none."""
    try:
        terms = _cached_terms(model, kernels)
    except TypeError:  # an unhashable family: ask it every time
        terms = model.decoder_terms(kernels)
    if terms is None:
        raise ConfigError(f"model {model.family_name} states no decoder terms (ModelFamily.decoder_terms): the "
                          "planner cannot size it")
    return terms


@functools.lru_cache(maxsize=4096)
def _cached_problem(model: Any, layout: Layout) -> str | None:
    problems = model.check_layout(layout)
    return problems[0].key if problems else None


def layout_problem(model: Any, tp: int, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                   vpp: int = 1, cp_mode: str = "ulysses", cp_a2a_size: int | None = None) -> str | None:
    """Why the model family refuses this layout (its first :class:`~loongforge.models.sizing.LayoutProblem`'s
    reason), or ``None``; the planner always uses sequence parallelism with tp > 1."""
    layout = Layout(tp=tp, pp=pp, dp=1, sequence_parallel=tp > 1, distributed_optimizer=False,
                    vpp=vpp if vpp > 1 else None, ep=ep, etp=etp, cp=cp, cp_mode=cp_mode, cp_a2a_size=cp_a2a_size)
    try:
        return _cached_problem(model, layout)
    except TypeError:  # an unhashable family
        problems = model.check_layout(layout)
        return problems[0].key if problems else None


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
    #: How attention exchanges a context-parallel sequence (``parallel.cp_mode``; meaningless at cp=1) and, for
    #: ``hybrid``, the Ulysses sub-group size.
    cp_mode: str = "ulysses"
    cp_a2a_size: int | None = None
    #: Activation offload: the first ``offload_layers`` layers of every model chunk of a stage move what they save
    #: for backward to host memory (``training.offload_activations``; 0: none).
    offload_layers: int = 0
    #: Chunked pipeline: every sequence cut into this many chunks that flow through the pipeline as micro-batches
    #: (``parallel.seq_chunks``; 1: off; only at cp=1 without vpp).
    seq_chunks: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self, num_layers: int) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp{self.cp}:{self.cp_mode}" + (str(self.cp_a2a_size) if self.cp_mode == "hybrid" else "")
                  ] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp != self.tp else []
        parts += [f"dp{self.dp}", f"mbs{self.micro_batch_size}x{self.num_microbatches}"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["distopt"] if self.distributed_optimizer else []
        parts += [f"rc:{self.recompute.describe(num_layers // (self.pp * self.vpp))}"]
        parts += [f"offload:{self.offload_layers}/{num_layers // (self.pp * self.vpp)}"] if self.offload_layers else []
        parts += [f"chunks{self.seq_chunks}"] if self.seq_chunks > 1 else []
        return " ".join(parts)

    def parallel_config(self) -> dict[str, Any]:
        """The ``parallel`` config mapping for this layout (``dp`` follows from the world size)."""
        hybrid = self.cp > 1 and self.cp_mode == "hybrid"
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp if self.vpp > 1 else None, "cp": self.cp,
                "cp_mode": self.cp_mode if self.cp > 1 else "ulysses",
                "cp_a2a_size": self.cp_a2a_size if hybrid else None,
                "ep": self.ep, "etp": self.etp, "sequence_parallel": self.sequence_parallel,
                "distributed_optimizer": self.distributed_optimizer, "seq_chunks": self.seq_chunks}

    def offloaded_layers(self, num_layers: int) -> frozenset[int]:
        """The 0-based global decoder layers ``offload_layers`` names: the first of every model chunk of every stage
        (megatron gives virtual chunk ``c`` of stage ``s`` the layers of block ``c * pp + s``)."""
        per_chunk = num_layers // (self.pp * self.vpp)
        return frozenset(block * per_chunk + i for block in range(self.pp * self.vpp)
                         for i in range(min(self.offload_layers, per_chunk)))


@dataclass(frozen=True)
class SearchSpace:
    """What the enumeration may vary; a fixed field narrows the search (``None``: let the planner choose)."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    #: Fixed micro-batch size (the config's, when it gives no global batch size to cut differently).
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    max_cp: int = 8
    #: The config's ``parallel.cp_mode`` and ``cp_a2a_size`` (a ring accepts any head count; hybrid needs cp a
    #: multiple of cp_a2a_size, above it), or ``auto``: every mode the model allows at each cp -- Ulysses, the
    #: ring, hybrid at every a2a size -- is a layout of its own, compared by memory and time.
    cp_mode: str = "ulysses"
    cp_a2a_size: int | None = None
    #: Whether the planner may offload the first k layers of a stage (``training.offload_activations.layers:
    #: auto``), like it chooses recompute; False keeps the workload's own offloaded layers.
    choose_offload: bool = False
    #: The chunk counts a layout may take (``parallel.seq_chunks``; see
    #: :func:`loongforge.config.chunk_settings.chunk_counts`): one count is the config's, which every layout keeps (a
    #: count above 1 rules out cp and vpp); several (``auto``) are ways to fit at cp=1 and tp=1 without vpp, fewest
    #: first.
    chunk_counts: tuple[int, ...] = (1,)
    try_vpp: bool = True
    #: Whether layouts without the distributed optimizer are compared too (it never costs time in the model).
    allow_plain_optimizer: bool = False
    tp_across_nodes: bool = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_choices(flavor: Any, layers_per_stage: int) -> list[RecomputePlan]:
    """No recompute, the family's selective module sets, then full recompute of 1..all layers of a stage."""
    plans = [RecomputePlan()]
    plans += [RecomputePlan("selective", modules) for modules in decoder_terms(flavor).selective_recompute]
    plans += [RecomputePlan("full", num_layers=k) for k in range(1, layers_per_stage + 1)]
    return plans


def enumerate_layouts(
    flavor: Any, num_devices: int, seq_length: int, ranks_per_node: int, space: SearchSpace, rejected: Counter
) -> Iterator[Candidate]:
    """Every buildable layout of the model family ``flavor`` on ``num_devices`` (recompute left at none; the planner
    adds it).

    ``rejected`` counts skipped combinations by reason (a parallel split the model refuses, a batch that does not
    cut evenly).
    """
    for tp in _divisors(num_devices):
        if tp > ranks_per_node and not space.tp_across_nodes:
            rejected["tp larger than a node"] += 1
            continue
        if (why := layout_problem(flavor, tp)) is not None:
            rejected[why] += 1
            continue
        for pp in _divisors(num_devices // tp):
            if (why := layout_problem(flavor, tp, pp)) is not None:
                rejected[why] += 1
                continue
            for cp in _divisors(num_devices // (tp * pp)):
                if cp > space.max_cp:
                    continue
                if cp > 1 and space.chunk_counts[0] > 1:
                    rejected["parallel.seq_chunks needs cp=1"] += 1
                    continue
                if cp > 1 and seq_length % (2 * cp * tp):
                    rejected["cp does not divide heads per tp rank or the sequence"] += 1
                    continue
                dp = num_devices // (tp * pp * cp)
                for mode in _cp_modes(flavor, tp, pp, cp, space, rejected):
                    yield from _experts_and_batches(flavor, tp, pp, cp, dp, space, rejected, mode)


def _cp_modes(flavor: Any, tp: int, pp: int, cp: int, space: SearchSpace,
              rejected: Counter) -> list[dict[str, Any]]:
    """The ``cp_mode``/``cp_a2a_size`` settings to try at this cp: the config's, or (``auto``) Ulysses, the ring and
    hybrid at every a2a size that splits cp into sub-groups of >= 2 ranks -- each kept when the model allows it."""
    if cp == 1:
        return [{"cp_mode": "ulysses", "cp_a2a_size": None}]
    if space.cp_mode != "auto":
        options = [{"cp_mode": space.cp_mode, "cp_a2a_size": space.cp_a2a_size}]
    else:
        options = [{"cp_mode": "ulysses", "cp_a2a_size": None}, {"cp_mode": "ring", "cp_a2a_size": None}]
        options += [{"cp_mode": "hybrid", "cp_a2a_size": a2a} for a2a in _divisors(cp) if 1 < a2a < cp]
    kept = []
    for option in options:
        a2a = option["cp_a2a_size"]
        why = ("cp is not a multiple of cp_a2a_size above it"
               if option["cp_mode"] == "hybrid" and (a2a is None or cp % a2a or cp <= a2a)
               else layout_problem(flavor, tp, pp, cp, **option))
        if why is not None:
            rejected[why] += 1
            continue
        kept.append(option)
    return kept


def _experts_and_batches(
    flavor: Any, tp: int, pp: int, cp: int, dp: int, space: SearchSpace, rejected: Counter, mode: dict[str, Any]
) -> Iterator[Candidate]:
    experts = decoder_terms(flavor).num_experts
    expert_choices = [(1, tp)]
    if experts:
        expert_choices = []
        for ep in _divisors(experts):
            for etp in sorted({1, tp}):
                why = (EXPERT_RANKS if (tp * cp * dp) % (ep * etp)
                       else layout_problem(flavor, tp, pp, cp, ep, etp, **mode))
                if why is not None:
                    rejected[why] += 1
                    continue
                expert_choices.append((ep, etp))
    sp_choices = (True,) if tp > 1 else (False,)
    # The distributed optimizer is offered only where there are data-parallel replicas to shard over (dp > 1). At
    # dp=1 -- one process, or context parallelism alone -- a chosen layout keeps the plain optimizer: sharding over
    # the context-parallel ranks alone is left to an explicit ``parallel.distributed_optimizer: true``.
    dist_opt = (False,) if dp == 1 else (True, False) if space.allow_plain_optimizer else (True,)
    for ep, etp in expert_choices:
        vpp_choices = [1] + ([v for v in (2, 4, 5, 8)
                              if pp > 1 and space.chunk_counts[0] == 1
                              and layout_problem(flavor, tp, pp, cp, ep, etp, v, **mode) is None]
                             if space.try_vpp else [])
        for mbs, num_micro in _batch_cuts(dp, space, rejected):
            for vpp in vpp_choices:
                if vpp > 1 and num_micro % pp:
                    rejected["vpp needs micro-batches divisible by pp"] += 1
                    continue
                for sp in sp_choices:
                    for distopt in dist_opt:
                        yield Candidate(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, sequence_parallel=sp,
                                        distributed_optimizer=distopt, micro_batch_size=mbs,
                                        num_microbatches=num_micro, seq_chunks=space.chunk_counts[0], **mode)


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
