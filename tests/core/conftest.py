"""Shared fixtures for core tests."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_cpu_world():
    """A one-process gloo world with megatron parallel state at TP=PP=1 and the CPU patches applied.

    Yields the CPU backend. Module-scoped because megatron's state is global: every test module that
    needs it gets a fresh world and tears it down, so tests that create their own world are unaffected.
    """
    import torch
    import torch.distributed as dist
    from loongforge.devices.cpu import CPUBackend
    from megatron.core import parallel_state, tensor_parallel

    backend = CPUBackend()
    backend.apply_patches()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    try:
        yield backend
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
