"""The planner for task-engine models: torch-native layouts (DDP, ZeRO-1, FSDP2, HSDP x cp x tp) sized and timed.

A task model states its sizes (:class:`~loongforge.models.task_terms.TaskTerms`); this module enumerates the
layouts :mod:`loongforge.parallel.torch_native` can run on N devices, predicts each one's peak memory per rank and
step time, and ranks those that fit. One process runs the model unwrapped. Per-block recompute (the task's
``recompute_option``) is tried where the task has it; the micro-batch size is the config's (a task step has no
gradient accumulation: the global batch is ``micro_batch_size x dp``), so layouts are ranked by time per sample.

Memory terms (bytes per rank; ``p`` is one model's parameters on a tensor-parallel rank, sharded over ``s`` ranks
by FSDP2/HSDP and whole under DDP/ZeRO-1):

* ``weights`` -- fp32 master parameters of every model (``4 p models / s``);
* ``grads`` -- fp32 gradients: of the models a step trains under FSDP2/HSDP (the others' stay ``None``), of every
  parameter under DDP (its buckets hold them all);
* ``optimizer`` -- AdamW's two fp32 moments of every model, over ``s`` ranks (ZeRO-1: over every rank);
* ``gathered`` -- FSDP2/HSDP: the parameters outside the blocks (the root unit, gathered for the whole step) and two
  blocks' (the one running and the one prefetched) in the compute dtype, plus one block's unsharded fp32 gradient
  before its reduce-scatter;
* ``activations`` -- the blocks' saved tensors for the micro-batch (``tokens / cp`` per rank; the split part over
  tp), or with recompute each block's input only, plus what the model keeps outside its blocks;
* ``backward_peak`` -- the transient gradients of a block's backward (context parallelism's exchanges add none
  that outlive the exchange: :func:`loongforge.devices.ulysses.all_to_all_blocks`); with recompute, the block being
  re-run holds its full activations again, which covers them (measured: the re-run block's tensors are freed as its
  gradients are made).

The compute dtype is bf16 only where ``training.precision: bf16`` reaches the model: FSDP2/HSDP's mixed-precision
policy. DDP, ZeRO-1 and one process compute in fp32 whatever the precision (the task engine casts nothing else).

Time terms (seconds per step): ``compute`` (3 forward passes' FLOPs, a 4th through the blocks with recompute, over
``cp x tp`` ranks), ``tp_comm`` (three all-reduces of a block's activations forward and three backward),
``cp_comm`` (Ulysses: q/k/v and the output exchanged each way), ``dp_comm`` (FSDP2: parameter all-gathers forward
and backward and the gradient reduce-scatter, overlapped with compute except the first unit's; DDP: the gradient
all-reduce overlapped with the backward except its last bucket; ZeRO-1 adds the updated parameters' broadcast)
and ``overhead`` (a calibrated cost per block and pass). Collectives are costed as in :mod:`~loongforge.planner.timing`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from loongforge.models.task_terms import TaskTerms
from loongforge.planner.hardware import ClusterSpec
from loongforge.planner.memory import MemoryEstimate
from loongforge.planner.planner import PlanAnswer
from loongforge.planner.timing import TimeCoefficients, TimeEstimate, ring_seconds

#: Strategies :mod:`loongforge.parallel.torch_native` runs; ``single``: one process, no wrapper.
SHARDED = ("fsdp2", "hsdp")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class TaskCandidate:
    """One torch-native layout: the strategy, cp and tp sizes, HSDP's shard size, per-block recompute."""

    strategy: str
    world_size: int
    cp: int = 1
    tp: int = 1
    shard_size: int = 1
    recompute: bool = False
    micro_batch_size: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.cp * self.tp)

    @property
    def param_shards(self) -> int:
        """Ranks one tensor-parallel slice of the parameters is sharded over."""
        if self.strategy == "fsdp2":
            return self.world_size // self.tp
        return self.shard_size if self.strategy == "hsdp" else 1

    def describe(self) -> str:
        kind = f"hsdp {self.world_size // self.shard_size}x{self.shard_size}" if self.strategy == "hsdp" \
            else self.strategy
        sizes = [f"{name}{size}" for name, size in (("tp", self.tp), ("cp", self.cp)) if size > 1]
        return " ".join([kind, *sizes, f"dp{self.dp}", f"mbs{self.micro_batch_size}"]
                        + (["recompute"] if self.recompute else []))

    def overrides(self, sizes: TaskTerms) -> list[str]:
        """The config overrides that run this layout (what ``loongforge plan --write`` applies)."""
        strategy = "ddp" if self.strategy == "single" else self.strategy
        out = [f"parallel.strategy={strategy}", f"parallel.cp={self.cp}", f"parallel.tp={self.tp}",
               f"parallel.fsdp_shard_size={self.shard_size if self.strategy == 'hsdp' else 'null'}"]
        if sizes.recompute_option:
            out.append(f"{sizes.recompute_option}={'true' if self.recompute else 'false'}")
        return out


@dataclass
class TaskEvaluated:
    candidate: TaskCandidate
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def pace(self) -> float:
        """What layouts are ranked by: seconds per sample (a step trains ``micro_batch_size x dp`` samples, so step
        times of different dp do not compare)."""
        return self.time.total / (self.candidate.micro_batch_size * self.candidate.dp)

    def describe(self, _sizes: Any = None) -> str:
        return f"{self.candidate.describe()} ({self.pace:.3g} s/sample)"


@dataclass(kw_only=True)
class TaskPlan(PlanAnswer):
    """The ranked layouts of a task model that fit, the rejections, and (none fitting) what would fit."""

    pace_unit: ClassVar[str] = " per sample"

    sizes: TaskTerms
    precision: str

    def what_failed(self) -> str:
        return f"no layout of this {self.sizes.blocks}-block model ({self.sizes.sample})"

    def infeasible_message(self) -> str:
        if not self.ranked and not self.near_misses:  # nothing the run's options allow at this device count
            why = "; ".join(self.sizes.notes) or "no layout divides its heads and tokens"
            return f"no layout of this model runs on {self.cluster.num_devices} device(s): {why}"
        return super().infeasible_message()


def compute_dtype(candidate: TaskCandidate, precision: str) -> str:
    """``bf16`` where FSDP2/HSDP's mixed-precision policy casts the parameters, else ``fp32`` (module docstring)."""
    return "bf16" if precision == "bf16" and candidate.strategy in SHARDED else "fp32"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def task_layouts(sizes: TaskTerms, cluster: ClusterSpec, micro_batch_size: int,
                 rejected: Counter) -> Iterator[TaskCandidate]:
    """Every torch-native layout of ``sizes`` on ``cluster.num_devices`` ranks; refused ones are counted."""
    world = cluster.num_devices
    recompute = (False, True) if sizes.recompute_option else (False,)
    if world == 1:
        for choice in recompute:
            yield TaskCandidate("single", 1, recompute=choice, micro_batch_size=micro_batch_size)
        return
    shapes: list[tuple[str, int, int, int]] = []
    for cp in _divisors(world) if sizes.context_parallel else [1]:
        for tp in _divisors(world // cp) if sizes.tensor_parallel else [1]:
            shapes += [(kind, cp, tp, 1) for kind in ("ddp", "zero1", "fsdp2")
                       if kind in sizes.strategies and (tp == 1 or kind == "fsdp2")]
            if tp == 1 and "hsdp" in sizes.strategies:
                shapes += [("hsdp", cp, 1, shard) for shard in _divisors(world) if 1 < shard < world]
    for kind, cp, tp, shard in shapes:
        if sizes.heads % (cp * tp) or any(size % tp for size in sizes.tp_divides):
            rejected["heads (or widths) not divisible by tp x cp"] += 1
            continue
        if sizes.tokens % cp:
            rejected[f"{sizes.tokens} tokens not divisible by cp"] += 1
            continue
        if tp > cluster.node_size:
            rejected["tp spans nodes"] += 1
            continue
        for choice in recompute:
            yield TaskCandidate(kind, world, cp, tp, shard, choice, micro_batch_size)


def _rank_params(sizes: TaskTerms, cand: TaskCandidate) -> tuple[float, float]:
    """(one block's, one model's) parameters on a tensor-parallel rank, before any sharding."""
    block = sizes.block_split_params / cand.tp + sizes.block_replicated_params
    return block, sizes.blocks * block + sizes.outside_params


def estimate_task_memory(sizes: TaskTerms, cand: TaskCandidate, precision: str,
                         fixed_bytes: float = 0.0) -> MemoryEstimate:
    """Peak bytes of one rank, by term (see the module docstring)."""
    dtype = compute_dtype(cand, precision)
    acts = sizes.activations[dtype]
    block, params = _rank_params(sizes, cand)
    shards = cand.param_shards
    optimizer_shards = cand.world_size if cand.strategy == "zero1" else shards
    trained = sizes.models_per_step if cand.strategy in SHARDED else sizes.models
    terms = {"weights": 4 * params * sizes.models / shards, "grads": 4 * params * trained / shards,
             "optimizer": 8 * params * sizes.models / optimizer_shards}
    if cand.strategy in SHARDED:
        terms["gathered"] = _DTYPE_BYTES[dtype] * (sizes.outside_params + 2 * block) + 4 * block
    tokens = cand.micro_batch_size * sizes.tokens / cand.cp
    one_block = tokens * (acts.replicated_per_token + acts.split_per_token / cand.tp) \
        + cand.micro_batch_size * acts.split_per_sample / cand.tp
    kept = tokens * acts.recompute_per_token if cand.recompute else one_block
    terms["activations"] = sizes.blocks * kept + tokens * acts.outside_per_token
    terms["backward_peak"] = one_block if cand.recompute else tokens * acts.backward_per_token
    terms["fixed"] = fixed_bytes
    return MemoryEstimate(terms, stage=0)


def estimate_task_time(sizes: TaskTerms, cand: TaskCandidate, precision: str, cluster: ClusterSpec,
                       coeffs: TimeCoefficients) -> TimeEstimate:
    """Seconds of one step, by term (see the module docstring)."""
    dtype = compute_dtype(cand, precision)
    mbs, width = cand.micro_batch_size, _DTYPE_BYTES[dtype]
    passes = 4 if cand.recompute else 3  # forward, backward (twice the forward), the recomputed forward
    flops = mbs * (passes * sizes.block_forward_flops + 3 * sizes.outside_forward_flops) / (cand.cp * cand.tp)
    compute = flops / (cluster.device_flops * coeffs.flops_scale)
    forwards = 2 if cand.recompute else 1
    activation = mbs * sizes.tokens / cand.cp * sizes.hidden * width  # one block's output on a rank
    tp_comm = sizes.blocks * 3 * (forwards + 1) * ring_seconds(activation, cand.tp, cluster, cand.tp, True, coeffs)
    exchanged = activation / cand.tp  # a rank's heads of q, k, v and the output, 4 exchanges each way
    cp_comm = sizes.blocks * 4 * (forwards + 1) * ring_seconds(exchanged, cand.cp, cluster, cand.cp * cand.tp,
                                                               False, coeffs)
    params = _rank_params(sizes, cand)[1]
    dp_comm = 0.0
    if cand.strategy in SHARDED:
        shards, span = cand.param_shards, cand.param_shards * cand.tp
        trained = params * sizes.models_per_step
        moved = (1 + forwards) * ring_seconds(trained * width, shards, cluster, span, False, coeffs) \
            + ring_seconds(trained * 4, shards, cluster, span, False, coeffs)
        if cand.strategy == "hsdp":  # the sharded gradients averaged across replicas
            moved += ring_seconds(trained * 4 / shards, cand.world_size // shards, cluster, cand.world_size, True,
                                  coeffs)
        dp_comm = max(0.0, moved - compute) + moved / sizes.blocks
    elif cand.strategy != "single":
        reduced = ring_seconds(params * sizes.models * 4, cand.world_size, cluster, cand.world_size, True, coeffs)
        dp_comm = max(0.0, reduced - compute * 2 / 3) + reduced / sizes.blocks
        if cand.strategy == "zero1":
            dp_comm += ring_seconds(params * sizes.models * 4, cand.world_size, cluster, cand.world_size, False,
                                    coeffs)
    overhead = coeffs.overhead_per_layer * sizes.blocks * (passes - 1)
    return TimeEstimate({"compute": compute, "tp_comm": tp_comm, "cp_comm": cp_comm, "dp_comm": dp_comm,
                         "overhead": overhead})


def _rank_key(ev: TaskEvaluated) -> tuple[float, float]:
    """Less time per sample first (a step trains ``micro_batch_size x dp`` samples, so step times of different dp
    do not compare), to the three digits the report prints (a model's finer differences are noise); then less
    memory."""
    return float(f"{ev.pace:.3g}"), ev.memory.total


def plan_task(sizes: TaskTerms, cluster: ClusterSpec, *, precision: str, micro_batch_size: int = 1,
              margin: float = 0.10, time_coefficients: TimeCoefficients | None = None, fixed_bytes: float = 0.0,
              search_minimum: bool = True) -> TaskPlan:
    """Rank every torch-native layout of ``sizes`` on ``cluster`` that fits memory (module docstring)."""
    coeffs = time_coefficients or TimeCoefficients()
    budget = cluster.device_memory * (1 - margin)
    rejected: Counter = Counter()
    ranked, misses = [], []
    for cand in task_layouts(sizes, cluster, micro_batch_size, rejected):
        ev = TaskEvaluated(cand, estimate_task_memory(sizes, cand, precision, fixed_bytes),
                           estimate_task_time(sizes, cand, precision, cluster, coeffs))
        if ev.memory.total <= budget:
            ranked.append(ev)
        else:
            rejected["exceeds memory" + (" even with recompute" if cand.recompute else "")] += 1
            misses.append(ev)
    ranked.sort(key=_rank_key)
    misses.sort(key=lambda ev: ev.memory.total)
    result = TaskPlan(sizes=sizes, precision=precision, cluster=cluster, ranked=ranked, rejected=rejected,
                      margin=margin, near_misses=misses[:3])
    if not ranked and search_minimum:
        if misses:
            result.min_memory = misses[0].memory.total / (1 - margin)
        result.min_devices = _smallest_device_count(sizes, cluster, precision, micro_batch_size, budget,
                                                    fixed_bytes)
    return result


def _smallest_device_count(sizes: TaskTerms, cluster: ClusterSpec, precision: str, micro_batch_size: int,
                           budget: float, fixed_bytes: float) -> int | None:
    """The fewest devices (of this memory) on which some layout fits: every count to 1024, then powers of two."""
    counts = list(range(cluster.num_devices + 1, 1025)) + [1 << k for k in range(11, 17)]
    for n in counts:
        wider = replace(cluster, num_devices=n)
        if any(estimate_task_memory(sizes, cand, precision, fixed_bytes).total <= budget
               for cand in task_layouts(sizes, wider, micro_batch_size, Counter())):
            return n
    return None
