"""Megatron's RNG tracker on a CPU-only process.

On CUDA, megatron keeps two kinds of generator: the CPU one (data order, CPU-side init) and the CUDA one
(dropout, GPU-side init), plus named CUDA states in ``CudaRNGStatesTracker`` (``model-parallel-rng`` differs per
tensor-parallel rank so that dropout in sharded regions differs per shard). On CPU the device generator *is* the
CPU generator, so the tracker's states are CPU generator states and forking swaps the CPU generator's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for ``random._get_cuda_rng_state`` (which indexes ``torch.cuda.default_generators``)."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``random._set_cuda_rng_state`` (which sets a CUDA default generator lazily)."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.set_rng_state(new_state)


def make_cpu_tracker_class(base: type) -> type:
    """Subclass megatron's ``CudaRNGStatesTracker`` with a CPU ``fork``.

    Megatron's ``fork`` warns when the CPU generator changed inside the forked region, assuming forked work
    draws from the CUDA generator. On CPU every draw inside the fork (dropout in tensor-parallel regions) is a
    CPU draw, so the warning would fire on every step; this ``fork`` does the same state swap without it.
    """

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """``CudaRNGStatesTracker`` whose named states are CPU generator states."""

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            """Run the body with generator state ``name``; save it back and restore the previous state after."""
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__qualname__ = "CpuRNGStatesTracker"
    return CpuRNGStatesTracker


def patch_rng_tracker() -> None:
    """Make ``megatron.core.tensor_parallel.random`` keep its RNG states on the CPU generator.

    CUDA behaviour: ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read and write
    ``torch.cuda.default_generators[i]``; ``CudaRNGStatesTracker.add`` and ``model_parallel_cuda_manual_seed``
    call ``torch.cuda.get_rng_state``/``manual_seed``. On CPU those raise (no CUDA driver). The patch replaces
    the two state functions in the module namespace (where the tracker and activation recompute look them up)
    and the tracker class (``initialize_rng_tracker`` instantiates the module-level name); the module's
    ``torch.cuda`` calls are covered by the torch view. A tracker created before patching is converted in place.
    """
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom, "_loongforge_cpu_rng", False):
        return
    cpu_tracker = make_cpu_tracker_class(mrandom.CudaRNGStatesTracker)
    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    mrandom.CudaRNGStatesTracker = cpu_tracker
    existing = mrandom._CUDA_RNG_STATE_TRACKER
    if existing is not None and type(existing).__name__ == "CudaRNGStatesTracker":
        existing.__class__ = cpu_tracker
    mrandom._loongforge_cpu_rng = True
