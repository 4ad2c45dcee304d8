"""A one-process megatron world for work outside a training run (conversion, ``loongforge generate``).

megatron-core builds models only inside its parallel state, which needs a process group even for one
process. Conversion always runs on the CPU backend at TP=PP=1: it only reshapes tensors, host memory is
the larger pool, and ``dist_checkpointing`` reshards a checkpoint written at any layout into this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from loongforge.errors import InteropError


@contextlib.contextmanager
def standalone_world(backend: Any = None, *, tp_size: int = 1) -> Iterator[Any]:
    """Yield the CPU backend (or ``backend``, a CPU-world one such as the ModelFamilySuite's recording backend)
    with a gloo world of one and megatron at TP=PP=1 -- or, for ``tp_size > 1``, a torchrun world of that
    many processes at that TP size (``loongforge eval``); tear both down after."""
    from megatron.core import parallel_state, tensor_parallel

    from loongforge.devices.cpu import CPUBackend
    from loongforge.parallel.distributed import init_distributed, shutdown_distributed

    backend = backend or CPUBackend()
    backend.apply_patches()
    info = init_distributed(backend)
    try:
        if info.world_size != tp_size:
            raise InteropError(f"this command runs in {tp_size} process(es) (its tensor-parallel size), "
                               f"not a world of {info.world_size}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield backend
    finally:
        shutdown_distributed(info)
