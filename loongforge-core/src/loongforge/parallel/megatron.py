"""The ``megatron`` parallel strategy: layout validation and megatron-core process-group setup.

Validation happens before any process group or model exists so that a wrong layout fails with one line
that names the numbers, instead of a hang or an assertion deep inside megatron. It has two parts:
:meth:`MegatronStrategy.validate` needs only the config and the world size; :meth:`MegatronStrategy.check_model`
also needs the model's sizes and the batch settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.config.schema import ParallelConfig
from loongforge.errors import ConfigError


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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_chunks(self) -> int:
        """Model chunks this rank builds (one per virtual pipeline stage)."""
        return self.vpp or 1


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is cut: micro-batches per data-parallel rank."""

    global_batch_size: int
    num_microbatches: int


class MegatronStrategy:
    """Tensor, pipeline (optionally interleaved) and data parallelism as megatron-core implements them."""

    name = "megatron"

    @staticmethod
    def validate(parallel: ParallelConfig, world_size: int, source: str = "config") -> Layout:
        """Derive ``dp`` from the world size; raise :class:`ConfigError` for impossible layouts."""
        for key in ("tp", "pp"):
            if getattr(parallel, key) < 1:
                raise ConfigError(f"{source}: parallel.{key} must be >= 1, got {getattr(parallel, key)}")
        model_parallel = parallel.tp * parallel.pp
        if world_size % model_parallel:
            raise ConfigError(
                f"{source}: tp*pp*dp must equal the {world_size} processes started; got tp={parallel.tp}, "
                f"pp={parallel.pp} (tp*pp={model_parallel} does not divide {world_size})"
            )
        if parallel.sequence_parallel and parallel.tp == 1:
            raise ConfigError(f"{source}: parallel.sequence_parallel needs parallel.tp > 1")
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
        )

    @staticmethod
    def check_model(layout: Layout, flavor: Any, training: Any, source: str = "config") -> BatchPlan:
        """Check that ``flavor`` splits over ``layout`` and the batch over ``dp``; return the batch plan.

        ``flavor`` needs ``num_attention_heads``, ``num_query_groups`` and ``num_layers``; ``training`` needs
        ``micro_batch_size`` and ``global_batch_size`` (None: one micro-batch per data-parallel rank).
        """
        heads, groups, layers = flavor.num_attention_heads, flavor.num_query_groups, flavor.num_layers
        if heads % layout.tp or groups % layout.tp:
            raise ConfigError(
                f"{source}: tp={layout.tp} must divide the model's attention heads ({heads}) and query groups "
                f"({groups})"
            )
        stages = layout.pp * layout.num_chunks
        if layers % stages:
            raise ConfigError(
                f"{source}: the model's {layers} layers do not split into pp*vpp={layout.pp}*{layout.num_chunks}"
                f" = {stages} equal stages"
            )
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
        )
