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

Hangs (``distributed.timeout_s``). A rank that stops -- SIGSTOP, a frozen node, a deadlock -- leaves the others
blocked in a collective, and the launcher, which reacts only to a dead process, waits with them. Two things end that:

* The timeout reaches every process group: the default group's, megatron's (``initialize_model_parallel``'s
  ``distributed_timeout_minutes``) and every ``new_group`` made while the run is up (torch's default for those is a
  fixed 30 minutes, whatever the default group's timeout is). A collective that waits longer raises.
* :class:`Heartbeat`, a watchdog of two background threads per rank. The training loop calls :meth:`Heartbeat.beat`
  once per step (a monotonic deadline is moved on; nothing else runs on the hot path). One thread writes this rank's
  heartbeat -- a counter and its last step -- into the rendezvous store every few seconds; the other checks the
  deadline. When a rank finishes no step for ``timeout_s`` its watchdog finds out which rank stopped: the ranks
  whose counters do not move over a few heartbeats (their processes are stopped, or gone), or, when every rank is
  alive, where each rank's main thread is. It prints one line naming them and exits with :data:`HUNG_EXIT_STATUS`,
  which ``loongforge train --max-restarts``, torchrun, the Slurm script and the Kubernetes manifests restart from
  the newest checkpoint. One rank works the verdict out (the first to claim it in the store); the others print it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

#: Exit status of a rank whose watchdog found the run hung (:class:`Heartbeat`): not 2 (an error to fix) nor 3
#: (preempted), so every launcher restarts the processes.
HUNG_EXIT_STATUS = 4
#: ``distributed.timeout_s``'s default: torch's own default process-group timeout.
DEFAULT_TIMEOUT_S = 1800


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


#: What :func:`_apply_group_timeout` replaced, put back by :func:`shutdown_distributed`.
_REPLACED: dict[str, Any] = {}


def _apply_group_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the timeout of every process group created from now on: torch's ``new_group(timeout=None)``
    default (a module-level 30 minutes that the default group's timeout does not change) and megatron's
    ``initialize_model_parallel`` (``distributed_timeout_minutes``, also 30), unless a caller passes its own."""
    from megatron.core import parallel_state

    if not _REPLACED:
        _REPLACED.update(pg=distributed_c10d.default_pg_timeout, nccl=distributed_c10d.default_pg_nccl_timeout,
                         megatron=parallel_state.initialize_model_parallel)
    distributed_c10d.default_pg_timeout = timeout
    if isinstance(_REPLACED["nccl"], timedelta):  # None where torch was built without NCCL
        distributed_c10d.default_pg_nccl_timeout = timeout
    original = _REPLACED["megatron"]

    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("distributed_timeout_minutes", timeout.total_seconds() / 60)
        return original(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel


def _restore_group_timeout() -> None:
    if not _REPLACED:
        return
    from megatron.core import parallel_state

    distributed_c10d.default_pg_timeout = _REPLACED["pg"]
    distributed_c10d.default_pg_nccl_timeout = _REPLACED["nccl"]
    parallel_state.initialize_model_parallel = _REPLACED["megatron"]
    _REPLACED.clear()


def group_timeout_s(timeout_s: float) -> float:
    """How long a collective waits under ``distributed.timeout_s``: the timeout plus the watchdog's time to find
    and name the rank that stopped (six heartbeats, at least 30 s), so that its line comes first -- a collective
    that timed out first would end the rank in a traceback that names no one."""
    return timeout_s + max(30.0, 6 * _heartbeat_interval(timeout_s))


def init_distributed(backend: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Initialise the default process group with the device backend's ``dist_backend``; every group of the run
    waits at most :func:`group_timeout_s` of ``timeout_s`` (``distributed.timeout_s``) for a collective."""
    if dist.is_initialized():  # a caller (a test, a notebook) set it up; use theirs
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), False, "existing")
    timeout = timedelta(seconds=group_timeout_s(timeout_s))
    _apply_group_timeout(timeout)
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
    if info.owns_group:
        _restore_group_timeout()


def _heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, between 0.5 and 15 s."""
    return min(15.0, max(0.5, timeout_s / 10))


def start_heartbeat(info: DistInfo, timeout_s: float) -> Heartbeat | None:
    """This rank's running :class:`Heartbeat` when the run has several processes started by torchrun (whose
    ``MASTER_ADDR``/``MASTER_PORT`` name the rendezvous store); ``None`` otherwise."""
    if info.world_size <= 1 or not info.owns_group or "MASTER_ADDR" not in os.environ \
            or "MASTER_PORT" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    prefix = f"loongforge/attempt-{attempt}/heartbeat/"

    def connect(timeout: float) -> dist.Store:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                               wait_for_workers=False)
        return dist.PrefixStore(prefix, client)

    hosted = "the launcher" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    heartbeat = Heartbeat(connect, info.rank, info.world_size, timeout_s, store_name=f"{host}:{port}, hosted by "
                                                                                     f"{hosted}")
    heartbeat.start()
    return heartbeat


def _where(thread_id: int | None) -> str:
    """The innermost frame of thread ``thread_id`` that is not the standard library's, as ``file:line (function)``."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    library = os.path.dirname(os.__file__)
    chosen = next((f for f in reversed(stack) if not f.filename.startswith(library)), stack[-1])
    parts = chosen.filename.replace(os.sep, "/").split("/")
    short = "/".join(parts[-3:]) if len(parts) > 3 else chosen.filename
    return f"{short}:{chosen.lineno} ({chosen.name})"


class Heartbeat:
    """The hang watchdog of one rank (see the module docstring).

    ``connect(timeout_s)`` opens a client of the rendezvous store (under this attempt's prefix). ``report`` prints
    the verdict and ``exit`` ends the process (``os._exit``: the main thread is blocked in a collective and cannot
    be interrupted); both are parameters for tests. :meth:`beat` arms and moves the deadline; before the first beat,
    and after :meth:`stop`, nothing fires.
    """

    def __init__(self, connect: Callable[[float], Any], rank: int, world_size: int, timeout_s: float, *,
                 interval_s: float | None = None, store_name: str = "the rendezvous store",
                 report: Callable[[str], None] | None = None, exit: Callable[[int], None] = os._exit) -> None:
        self.connect, self.rank, self.world_size, self.timeout_s = connect, rank, world_size, timeout_s
        self.interval_s = interval_s if interval_s is not None else _heartbeat_interval(timeout_s)
        self.store_name = store_name
        self.report = report or (lambda line: print(f"[loongforge] {line}", file=sys.stderr, flush=True))
        self.exit = exit
        #: The last step the loop finished, and when the watchdog fires (monotonic; ``None``: not armed).
        self.step = 0
        self.deadline: float | None = None
        self._main = threading.main_thread().ident
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the loop's side -----------------------------------------------------------------------------------------
    def beat(self, step: int) -> None:
        """At a step boundary: ``step`` steps are done; the next boundary must come within ``timeout_s``."""
        self.step = step
        self.deadline = time.monotonic() + self.timeout_s

    def stop(self) -> None:
        """Disarm and end both threads, waiting for a store write in flight to return (bounded by the store's own
        timeout). Why wait: a daemon thread still inside the store's C++ call when the interpreter finalises is
        torn down by the runtime mid-call, and the process aborts ("terminate called without an active exception",
        exit 134) after a run that finished. The threads stay daemons so a process that exits without ``stop`` (a
        crash) is not held up."""
        self.deadline = None
        self._stopped.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self._store_timeout_s() + 1.0)

    def start(self) -> None:
        """Start the publishing and the watching thread."""
        for target, name in ((self._publish, "loongforge-heartbeat"), (self._watch, "loongforge-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _store_timeout_s(self) -> float:
        """How long one store connection or write may take before it gives up."""
        return max(2.0, 2 * self.interval_s)

    # -- the threads ---------------------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Write ``counter step`` under this rank's key every ``interval_s`` (a failing store is retried)."""
        counter, store = 0, None
        while True:
            try:
                store = store or self.connect(self._store_timeout_s())
                counter += 1
                store.set(f"rank-{self.rank}", f"{counter} {self.step}")
            except Exception:  # noqa: BLE001 -- the store's host may be the stopped process; try again later
                store = None
            if self._stopped.wait(self.interval_s):
                return

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.interval_s)):
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()
                return

    def _fire(self) -> None:
        try:
            line = self._verdict()
        except Exception as exc:  # noqa: BLE001 -- the store is gone too: say what is known
            line = (f"rank {self.rank}: {self._waiting()}, and {self.store_name} does not answer "
                    f"({type(exc).__name__}), so the rank that stopped cannot be named (it may be the store's host)")
        if self._stopped.is_set():  # the run ended while the verdict was worked out
            return
        self.report(f"error: hung: {line}; exiting with status {HUNG_EXIT_STATUS} so the job restarts from its "
                    "newest checkpoint")
        self.exit(HUNG_EXIT_STATUS)

    def _waiting(self) -> str:
        return f"no step after step {self.step} finished in {self.timeout_s:g} s (distributed.timeout_s)"

    def _verdict(self) -> str:
        """The line naming the stopped rank(s): worked out by the first rank to claim it, read by the others."""
        store = self.connect(max(5.0, 4 * self.interval_s))
        store.set(f"where-{self.rank}", _where(self._main))
        if store.add("verdict-claims", 1) != 1:  # another rank works it out
            patience = time.monotonic() + 4 * self.interval_s + 10
            while time.monotonic() < patience:
                if store.check(["verdict"]):
                    return store.get("verdict").decode()
                time.sleep(0.2)
        verdict = self._diagnose(store)
        store.set("verdict", verdict)
        return verdict

    def _read(self, store: Any, prefix: str) -> dict[int, str]:
        keys = [f"{prefix}{rank}" for rank in range(self.world_size)]
        present = [(rank, key) for rank, key in enumerate(keys) if store.check([key])]
        values = store.multi_get([key for _, key in present]) if present else []
        return {rank: value.decode() for (rank, _), value in zip(present, values, strict=True)}

    def _diagnose(self, store: Any) -> str:
        first = self._read(store, "rank-")
        time.sleep(2.5 * self.interval_s)  # a live rank's counter moves at least twice in this time
        second = self._read(store, "rank-")
        stopped = [rank for rank in range(self.world_size) if rank != self.rank
                   and (rank not in second or first.get(rank) == second[rank])]
        waiting = self._waiting()
        if stopped:
            silent = f"{2.5 * self.interval_s:.1f}".removesuffix(".0")
            return (f"{_ranks(stopped)} stopped responding (no heartbeat for {silent} s: the process is stopped, "
                    f"frozen or gone); {waiting}")
        time.sleep(self.interval_s)  # the others have written where their main threads are
        places: dict[str, list[int]] = defaultdict(list)
        for rank, where in sorted(self._read(store, "where-").items()):
            places[where].append(rank)
        shown = "; ".join(f"{_ranks(ranks)} in {where}" for where, ranks in
                          sorted(places.items(), key=lambda item: len(item[1]))[:4])
        return (f"every rank is alive but {waiting}: a deadlock, or a step slower than the timeout "
                f"({shown or 'no rank said where it is'})")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"ranks {shown}"
