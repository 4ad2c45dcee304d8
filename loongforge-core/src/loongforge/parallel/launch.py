"""``loongforge train --nproc N``: start N local training processes with torch's elastic launcher.

Why not just document ``torchrun``: for one machine the convenience matters, and going through
``torch.distributed.run`` (standalone rendezvous on a free port) gives the children exactly the
environment torchrun gives them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``), so there
is one code path for both. The layout is checked against N before any process starts (a wrong ``tp`` fails
in a second, not after N imports of megatron), threads are divided between the processes, and a failing
child's exit status is returned without torch's failure report: rank 0 has already printed the reason.

Preemption (``checkpoint.save_on_signal``): torch's launcher answers SIGTERM by passing it on and killing the
workers after a timeout, and SIGUSR1 (Slurm's warning) would end the launcher alone. Here both are passed on to
every worker and nothing else happens: the workers save at their next step boundary and exit with status 3
(``loongforge.train.preemption``), which this launcher then returns like any worker's status.

Restarts (``--max-restarts N``): when a process dies -- killed, or a crash with a traceback -- the launcher starts
all N processes again, up to N times, and they resume from the newest checkpoint (``checkpoint.resume: auto``, which
``--max-restarts`` requires). The restart loop is here rather than torch's (``torchrun --max-restarts``, which works
too, see :mod:`loongforge.parallel.distributed`) because torch restarts on any non-zero status: a preempted run
(status 3, saved on purpose) would start training again, and an error the user must fix (status 2) would fail the
same way N more times. Each attempt is a fresh standalone rendezvous on a free port.

Hangs: a rank whose watchdog finds the run hung exits with status 4 (:mod:`loongforge.parallel.distributed`), and
torch's launcher ends the others with SIGTERM, then SIGKILL after its shutdown timeout (30 s). A *stopped* rank (the
SIGSTOPped or frozen one the watchdog named) cannot act on SIGTERM until it is continued, so the launcher would spend
the whole timeout on it: it is killed as soon as the SIGTERM is pending (:func:`_killing_stopped_workers`), and the
restart comes within seconds of the watchdog's line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from loongforge.config.schema import AUTO_RESUMES
from loongforge.errors import ConfigError, TrainingPreempted

#: Exit statuses after which the processes are not restarted: done, an error to fix (the CLI's ``error:`` lines),
#: preempted (saved; the job is meant to end).
_FINAL_STATUSES = (0, 2, TrainingPreempted.exit_status)


def launch_local(config: Any, nproc: int, child_args: Sequence[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m loongforge.cli *child_args`` in ``nproc`` processes on this machine, restarting all of them
    after a process dies up to ``max_restarts`` times; return the exit status."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts and config.checkpoint.resume not in AUTO_RESUMES:
        raise ConfigError(f"{config.source}: --max-restarts restarts the processes from the newest checkpoint, which "
                          f"needs checkpoint.resume: auto (it is {config.checkpoint.resume!r})")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc starts its own processes; under torchrun, leave it out")
    from loongforge.plugins import get_registry

    strategy = get_registry("strategy").load(config.parallel.strategy, where=f"parallel.strategy in {config.source}")
    strategy.validate(config.parallel, nproc, config.source)

    # torchrun would set 1 thread per process and warn; sharing the cores is the better default.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    forward = config.checkpoint.save_on_signal
    # torch's launcher handles these signals by stopping the workers; the preemption signals are ours to pass on.
    handled = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"] if forward else []
    command = ["--standalone", "--nproc-per-node", str(nproc), *handled, "--module", "loongforge.cli", *child_args]
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)  # its "failed (exitcode: 2)" report repeats what rank 0 printed
    try:
        with _forwarding_preemption_signals() if forward else contextlib.nullcontext():
            status, failure = _attempt(command)
            for restart in range(1, max_restarts + 1):
                if status in _FINAL_STATUSES:
                    break
                print(f"[loongforge] {failure}: restarting the {nproc} processes (restart {restart} of "
                      f"{max_restarts}); they resume from the newest checkpoint", file=sys.stderr, flush=True)
                status, failure = _attempt(command)
    finally:
        elastic_log.setLevel(level)
    return status


def _attempt(command: list[str]) -> tuple[int, str]:
    """One run of torch's launcher: the exit status (a signal N as 128 + N) and which rank failed how."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        with _killing_stopped_workers():
            run(parse_args(command))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:
            return 128 - failure.exitcode, f"rank {rank} was killed by {failure.signal_name()}"
        return failure.exitcode, f"rank {rank} exited with status {failure.exitcode}"
    return 0, ""


#: Signals torch's launcher ends its workers with (SIGTERM after a failure, or the one it was sent).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _killing_stopped_workers() -> Iterator[None]:
    """While in the block, a worker process that is stopped with a signal to end it pending is killed (SIGKILL) within
    half a second: it cannot act on that signal before it is continued, and torch's launcher would wait its whole
    shutdown timeout for it. A stopped worker nobody is ending is left alone."""
    import psutil

    done = threading.Event()

    def watch() -> None:
        launcher = psutil.Process()
        while not done.wait(0.5):
            for worker in launcher.children():
                with contextlib.suppress(psutil.Error, OSError):
                    if worker.status() == psutil.STATUS_STOPPED and _ending_signal_pending(worker.pid):
                        worker.kill()

    thread = threading.Thread(target=watch, name="loongforge-stopped-workers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _ending_signal_pending(pid: int) -> bool:
    """Whether process ``pid`` has one of :data:`_ENDING_SIGNALS` pending, from Linux's ``/proc/PID/status`` (where
    there is none, the ``OSError`` leaves a stopped worker to torch's timeout as before)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    pending = masks[0] | masks[1] if len(masks) == 2 else 0
    return any(pending >> (sig - 1) & 1 for sig in _ENDING_SIGNALS)


@contextlib.contextmanager
def _forwarding_preemption_signals() -> Iterator[None]:
    """While in the block, SIGTERM and SIGUSR1 sent to this launcher go on to each of its worker processes."""
    import psutil

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    launcher = psutil.Process()

    def forward(signum: int, frame: Any) -> None:
        for worker in launcher.children():
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.send_signal(signum)

    forwarded = [getattr(signal, name) for name in TrainingPreempted.signals if hasattr(signal, name)]
    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
