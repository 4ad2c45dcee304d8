"""Process-group setup: torchrun's environment when present, else a one-process group on a free port.

megatron-core needs ``torch.distributed`` even for a single process (its parallel state is built from
process groups), so a plain ``loongforge train`` creates a world of one. Under torchrun the standard
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` variables are used as is.

Elastic restarts (``torchrun --max-restarts N``, ``loongforge train --nproc N --max-restarts M``): torch's launcher
hosts one key-value store for the whole job (``TORCHELASTIC_USE_AGENT_STORE``) and starts every new worker group
on the same one, without a namespace per attempt. The previous group's keys are still there, so the restarted
ranks read the dead ranks' addresses and wait for them until the process-group timeout (30 minutes) -- a restart
that never starts. Each attempt (``TORCHELASTIC_RESTART_COUNT``) therefore gets keys of its own here. The count
is kept by each node's launcher; on several nodes, where one node can restart without counting it,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt, torch's own switch) is the safe setting.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    #: Whether this call created the default process group (and so must destroy it).
    owns_group: bool
    launcher: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _attempt_store(attempt: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """The launcher's shared store under a prefix of restart ``attempt``, or ``None`` (the default ``env://``
    rendezvous) when the launcher does not share its store: then rank 0 hosts a fresh one for every attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"loongforge/attempt-{attempt}/", store)


def init_distributed(backend: Any, *, timeout_minutes: int = 30) -> DistInfo:
    """Initialise the default process group with the device backend's ``dist_backend``."""
    if dist.is_initialized():  # a caller (a test, a notebook) set it up; use theirs
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), False, "existing")
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        backend.set_device(local_rank)
        dist.init_process_group(backend.dist_backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=_attempt_store(attempt, world_size, timeout))
        return DistInfo(rank, world_size, local_rank, True, f"torchrun, restart {attempt}" if attempt else "torchrun")
    backend.set_device(0)
    dist.init_process_group(
        backend.dist_backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
    )
    return DistInfo(0, 1, 0, True, "single process")


def shutdown_distributed(info: DistInfo) -> None:
    """Destroy megatron's groups and, if we created it, the default group (so a process can run again)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()
