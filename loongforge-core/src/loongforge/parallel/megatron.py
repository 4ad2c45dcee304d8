"""The ``megatron`` parallel strategy: layout validation and megatron-core process-group setup.

Validation happens before any process group or model exists so that a wrong layout fails with one line
that names the numbers, instead of a hang or an assertion deep inside megatron. It has two parts:
:meth:`MegatronStrategy.validate` needs only the config and the world size; :meth:`MegatronStrategy.check_model`
also needs the model's sizes and the batch settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.parallel.strategy import ParallelStrategy

if TYPE_CHECKING:  # annotations only: parallel strategies sit below config, which resolves names to them
    from loongforge.config.schema import ParallelConfig

#: Megatron token dispatchers that run without Transformer Engine / DeepEP.
MOE_DISPATCHERS = ("alltoall", "allgather")

#: ``parallel.cp_mode`` -> megatron's ``TransformerConfig.cp_comm_type`` (what Transformer Engine's attention
#: runs on CUDA; the local attention reads it too: :class:`loongforge.devices.sdpa_attention.SDPAttention`).
CP_COMM_TYPES = {"ulysses": "a2a", "ring": "p2p", "hybrid": "a2a+p2p"}


@dataclass(frozen=True)
class Layout:
    """A validated layout: sizes of each parallel dimension for one world size."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    #: Virtual pipeline stages per pipeline rank (None: one model chunk per rank).
    vpp: int | None = None
    #: Expert parallel size and expert tensor parallel size (MoE); etp defaults to tp.
    ep: int = 1
    etp: int | None = None
    moe_dispatcher: str = "alltoall"
    #: Overlap the MoE all-to-alls with compute (:mod:`loongforge.parallel.moe_overlap_check` says how, per device).
    moe_a2a_overlap: bool = False
    #: Context-parallel ranks that share each sequence, how attention exchanges it (``ulysses``, ``ring``,
    #: ``hybrid``) and, for ``hybrid``, the size of the Ulysses sub-groups.
    cp: int = 1
    cp_mode: str = "ulysses"
    cp_a2a_size: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_chunks(self) -> int:
        """Model chunks this rank builds (one per virtual pipeline stage)."""
        return self.vpp or 1

    @property
    def head_split(self) -> int:
        """Ranks that split each layer's attention heads and query groups: tp, times cp under Ulysses (heads
        over the cp group) or the sub-group size under hybrid; a ring keeps the heads whole."""
        if self.cp == 1 or self.cp_mode == "ring":
            return self.tp
        return self.tp * (self.cp_a2a_size if self.cp_mode == "hybrid" else self.cp)

    @property
    def cp_description(self) -> str:
        """``cp=4 ring``, ``cp=4 hybrid a2a=2``, ``cp=2 ulysses`` (``cp=1`` without context parallelism)."""
        if self.cp == 1:
            return "cp=1"
        return f"cp={self.cp} {self.cp_mode}" + (f" a2a={self.cp_a2a_size}" if self.cp_mode == "hybrid" else "")

    @property
    def cp_comm_type(self) -> str | None:
        """Megatron's name for this context-parallel exchange (None without context parallelism)."""
        return CP_COMM_TYPES[self.cp_mode] if self.cp > 1 else None


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is cut: micro-batches per data-parallel rank."""

    global_batch_size: int
    num_microbatches: int


class MegatronStrategy(ParallelStrategy):
    """Tensor, pipeline (optionally interleaved) and data parallelism as megatron-core implements them."""

    name = "megatron"
    engine: ClassVar[str] = "megatron"

    @staticmethod
    def validate(parallel: ParallelConfig, world_size: int, source: str = "config") -> Layout:
        """Derive ``dp`` from the world size; raise :class:`ConfigError` for impossible layouts."""
        for key in ("tp", "pp", "cp"):
            if getattr(parallel, key) < 1:
                raise ConfigError(f"{source}: parallel.{key} must be >= 1, got {getattr(parallel, key)}")
        model_parallel = parallel.tp * parallel.pp * parallel.cp
        if world_size % model_parallel:
            raise ConfigError(
                f"{source}: tp*pp*cp*dp must equal the {world_size} processes started; got tp={parallel.tp}, "
                f"pp={parallel.pp}, cp={parallel.cp} (tp*pp*cp={model_parallel} does not divide {world_size})"
            )
        if parallel.sequence_parallel and parallel.tp == 1:
            raise ConfigError(f"{source}: parallel.sequence_parallel needs parallel.tp > 1")
        MegatronStrategy._validate_experts(parallel, world_size, source)
        MegatronStrategy._validate_cp_mode(parallel, source)
        if parallel.vpp is not None:
            if parallel.vpp < 1:
                raise ConfigError(f"{source}: parallel.vpp must be >= 1 or null, got {parallel.vpp}")
            if parallel.pp == 1:
                raise ConfigError(f"{source}: parallel.vpp={parallel.vpp} needs parallel.pp > 1")
        return Layout(
            tp=parallel.tp,
            pp=parallel.pp,
            dp=world_size // model_parallel,
            sequence_parallel=parallel.sequence_parallel,
            distributed_optimizer=parallel.distributed_optimizer,
            vpp=parallel.vpp if parallel.vpp and parallel.vpp > 1 else None,
            ep=parallel.ep,
            etp=parallel.etp,
            moe_dispatcher=parallel.moe_dispatcher,
            moe_a2a_overlap=parallel.moe_a2a_overlap,
            cp=parallel.cp,
            cp_mode=parallel.cp_mode,
            cp_a2a_size=parallel.cp_a2a_size,
        )

    @staticmethod
    def _validate_cp_mode(parallel: ParallelConfig, source: str) -> None:
        """``hybrid`` needs a Ulysses sub-group size that splits cp into at least two sub-groups of >= 2 ranks; the
        size means nothing for the other modes."""
        a2a = parallel.cp_a2a_size
        if parallel.cp_mode == "auto":
            raise ConfigError(f"{source}: parallel.cp_mode auto is the planner's to choose: set parallel: auto, or "
                              "write a config with loongforge plan --write")
        if parallel.cp_mode != "hybrid":
            if a2a is not None:
                raise ConfigError(f"{source}: parallel.cp_a2a_size is for parallel.cp_mode: hybrid, not "
                                  f"{parallel.cp_mode!r}")
            return
        if parallel.cp == 1:
            return
        if a2a is None or a2a < 2 or a2a >= parallel.cp or parallel.cp % a2a:
            raise ConfigError(f"{source}: parallel.cp_a2a_size must divide parallel.cp={parallel.cp} with "
                              f"1 < cp_a2a_size < cp for cp_mode hybrid, got {a2a}")

    @staticmethod
    def _validate_experts(parallel: ParallelConfig, world_size: int, source: str) -> None:
        """Expert layout: megatron lays ep*etp over the same ranks as dp*tp (per pipeline stage), so
        etp*ep*pp must divide the world size."""
        if parallel.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError(
                f"{source}: parallel.moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, "
                f"got {parallel.moe_dispatcher!r}"
            )
        if parallel.moe_a2a_overlap and (parallel.ep < 2 or parallel.moe_dispatcher != "alltoall"):
            raise ConfigError(f"{source}: parallel.moe_a2a_overlap overlaps the expert-parallel all-to-alls, so it "
                              f"needs parallel.ep > 1 and moe_dispatcher alltoall; got ep={parallel.ep}, "
                              f"moe_dispatcher={parallel.moe_dispatcher}")
        etp = parallel.etp if parallel.etp is not None else parallel.tp
        if parallel.ep < 1 or etp < 1:
            raise ConfigError(f"{source}: parallel.ep and parallel.etp must be >= 1, got ep={parallel.ep} etp={etp}")
        expert_ranks = etp * parallel.ep * parallel.pp
        if world_size % expert_ranks:
            raise ConfigError(
                f"{source}: etp*ep*pp must divide the {world_size} processes started; got etp={etp}, "
                f"ep={parallel.ep}, pp={parallel.pp} (etp*ep*pp={expert_ranks})"
            )

    @staticmethod
    def check_model(
        layout: Layout, flavor: Any, training: Any, source: str = "config", seq_length: int | None = None
    ) -> BatchPlan:
        """Check that the model family ``flavor`` splits over ``layout`` and the batch over ``dp``; return the batch
        plan.

        What the layout needs from the model (heads, layers, experts against tp/cp/pp/ep) is the family's own
        pre-flight, ``flavor.check_layout(layout)`` (:meth:`loongforge.models.family.ModelFamily.check_layout`); its
        first problem fails here in one line. ``training`` needs ``micro_batch_size`` and ``global_batch_size``
        (None: one micro-batch per data-parallel rank). ``seq_length`` (the training sequence length) is checked
        against ``cp`` when given.
        """
        problems = flavor.check_layout(layout)
        if problems:
            raise ConfigError(f"{source}: {problems[0].message}")
        if layout.cp > 1:
            _check_context_parallel(layout, seq_length, source)
        micro = training.micro_batch_size
        if micro < 1:
            raise ConfigError(f"{source}: training.micro_batch_size must be >= 1, got {micro}")
        per_pass = micro * layout.dp
        global_batch = training.global_batch_size or per_pass
        if global_batch % per_pass:
            raise ConfigError(
                f"{source}: training.global_batch_size ({global_batch}) must be a multiple of micro_batch_size*dp"
                f" ({micro}*{layout.dp} = {per_pass})"
            )
        num_micro = global_batch // per_pass
        if layout.vpp and num_micro % layout.pp:
            raise ConfigError(
                f"{source}: parallel.vpp needs micro-batches per step ({num_micro} = global_batch_size "
                f"{global_batch} / (micro_batch_size*dp {per_pass})) to be a multiple of pp={layout.pp}"
            )
        return BatchPlan(global_batch_size=global_batch, num_microbatches=num_micro)

    @staticmethod
    def initialize(layout: Layout) -> None:
        """Create megatron-core's tensor/pipeline/data process groups (torch.distributed must be up)."""
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            context_parallel_size=layout.cp,
        )
        _initialize_hybrid_context_parallel(layout)


def _initialize_hybrid_context_parallel(layout: Layout) -> None:
    """Build the Ulysses sub-groups and ring groups of ``cp_mode: hybrid`` and hand them to megatron as its
    hierarchical context-parallel groups (``pg_collection.hcp``, where attention looks for them).

    Megatron builds them itself from ``hierarchical_context_parallel_sizes`` only with ``einops`` installed, which
    core does not need otherwise; the layout is the same (:func:`loongforge.parallel.context.hybrid_groups`).
    Other modes clear the groups a previous run in this process may have left.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from loongforge.parallel.context import hybrid_groups

    groups = None
    if layout.cp > 1 and layout.cp_mode == "hybrid":
        every_cp_group: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every_cp_group, parallel_state.get_context_parallel_global_ranks())
        unique = sorted({tuple(ranks) for ranks in every_cp_group})
        groups = list(hybrid_groups(unique, layout.cp_a2a_size))
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = groups


def _check_context_parallel(layout: Layout, seq_length: int | None, source: str) -> None:
    """cp splits each sequence into 2*cp chunks (rank i holds chunks i and 2*cp-1-i, which balances causal attention
    work); the heads over tp*cp are the model's to check (``check_layout``)."""
    if seq_length is None:
        return
    multiple = 2 * layout.cp * (layout.tp if layout.sequence_parallel else 1)
    if seq_length % multiple:
        detail = "2*cp*tp with sequence_parallel" if layout.sequence_parallel else "2*cp"
        raise ConfigError(
            f"{source}: data.seq_length ({seq_length}) must be a multiple of {detail} = {multiple} (each "
            "context-parallel rank holds 2 of 2*cp equal chunks of every sequence)"
        )
