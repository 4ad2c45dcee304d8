"""The ``megatron`` parallel strategy: layout validation and megatron-core process-group setup.

Validation happens before any process group exists so that a wrong layout fails with one line that
names the numbers, instead of a hang or an assertion deep inside megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class MegatronStrategy:
    """Tensor, pipeline and data parallelism as megatron-core implements them."""

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
        return Layout(
            tp=parallel.tp,
            pp=parallel.pp,
            dp=world_size // model_parallel,
            sequence_parallel=parallel.sequence_parallel,
            distributed_optimizer=parallel.distributed_optimizer,
        )

    @staticmethod
    def initialize(layout: Layout) -> None:
        """Create megatron-core's tensor/pipeline/data process groups (torch.distributed must be up)."""
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
        )
