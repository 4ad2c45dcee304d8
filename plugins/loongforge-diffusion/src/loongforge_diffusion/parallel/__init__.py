"""Sequence-level parallelism and packing for the Wan DiT: Ulysses context parallelism and packed videos."""

from loongforge_diffusion.parallel.collectives import all_reduce_gradients, gather_tokens, sum_partials
from loongforge_diffusion.parallel.forward import context_parallel_forward, local_prediction, packed_forward
from loongforge_diffusion.parallel.group import ContextParallel
from loongforge_diffusion.parallel.layout import TokenLayout
from loongforge_diffusion.parallel.step import context_parallel_step

__all__ = [
    "ContextParallel",
    "TokenLayout",
    "all_reduce_gradients",
    "context_parallel_forward",
    "context_parallel_step",
    "gather_tokens",
    "local_prediction",
    "packed_forward",
    "sum_partials",
]
