"""A rank that stops is found, named and restarted (issue 45, item 3).

Measured on main: with one rank SIGSTOPped the other waited past 250 s -- until gloo's hard-coded 30 minutes --
because no config reached the process groups' timeout, nothing watched for progress, and ``--max-restarts`` reacts
only to a dead process.

Now ``distributed.timeout_s`` (``--dist-timeout``) sets every process group's timeout (the default group, megatron's
groups and any made later; plus the watchdog's time to speak first), and a heartbeat watchdog on each rank ends a
run whose ranks finish no step for that long: it names the rank that stopped and exits with status 4, which
``--max-restarts`` restarts; that launcher kills the stopped rank at once rather than after torch's 30 s shutdown
timeout. Here: the timeout on every group, the watchdog on a real store with in-process ranks, the setting's
checks, and the launcher's handling of a stopped process. The end-to-end reproduction -- rank 1 of a 2-process run
SIGSTOPped, the job ended within the timeout + 60 s naming it, restarted and resumed bit for bit -- is the
``dp2-nproc-frozen`` case of tests/core/test_elastic_restart.py, which shares the uninterrupted run it compares with.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import psutil
import torch.distributed as dist
from loongforge.cli import main
from loongforge.parallel import distributed as lf_dist
from loongforge.parallel.distributed import HUNG_EXIT_STATUS, Heartbeat, group_timeout_s
from loongforge.parallel.launch import _killing_stopped_workers

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def _timeout(group) -> timedelta:
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout


def test_the_timeout_reaches_every_process_group():
    """The default group, each of megatron's groups (gloo ones too) and a group made afterwards wait the configured
    time (plus the watchdog's grace), not torch's and megatron's fixed 30 minutes; shutting down restores those."""
    from loongforge.devices.cpu import CPUBackend
    from megatron.core import parallel_state

    backend = CPUBackend()
    backend.apply_patches()
    info = lf_dist.init_distributed(backend, timeout_s=40)
    expected = timedelta(seconds=group_timeout_s(40))
    assert expected == timedelta(seconds=70)  # 40 s, plus 30 s for the watchdog to name the rank first
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        groups = {"world": dist.group.WORLD, "later": dist.new_group([0]),
                  "tp": parallel_state.get_tensor_model_parallel_group(),
                  "pp": parallel_state.get_pipeline_model_parallel_group(),
                  "dp": parallel_state.get_data_parallel_group(),
                  "dp-gloo": parallel_state.get_data_parallel_group_gloo(),
                  "cp": parallel_state.get_context_parallel_group(),
                  "ep": parallel_state.get_expert_model_parallel_group()}
        assert {name: _timeout(group) for name, group in groups.items()} == dict.fromkeys(groups, expected)
    finally:
        lf_dist.shutdown_distributed(info)
    from torch.distributed import distributed_c10d

    assert distributed_c10d.default_pg_timeout == timedelta(minutes=30)


class _Ranks:
    """Heartbeats of ``world`` in-process "ranks" on one store, each reporting into ``lines`` and exiting into
    ``exits`` (one release of ``exited`` each) instead of ending the process."""

    def __init__(self, world: int, timeout_s: float, interval_s: float) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        self.lines: list[tuple[int, str]] = []
        self.exits: list[tuple[int, int]] = []
        self.exited = threading.Semaphore(0)
        self.ranks = [Heartbeat(self._connect, rank, world, timeout_s, interval_s=interval_s,
                                report=lambda line, rank=rank: self.lines.append((rank, line)),
                                exit=lambda status, rank=rank: self._exit(rank, status)) for rank in range(world)]

    def _connect(self, timeout: float):
        client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timedelta(seconds=timeout),
                               wait_for_workers=False)
        return dist.PrefixStore("loongforge/attempt-0/heartbeat/", client)

    def _exit(self, rank: int, status: int) -> None:
        self.exits.append((rank, status))
        self.exited.release()


def test_the_watchdog_names_the_rank_that_stopped():
    ranks = _Ranks(3, timeout_s=1.0, interval_s=0.4)
    for heartbeat in ranks.ranks:
        heartbeat.start()
        heartbeat.beat(7)
    ranks.ranks[2].stop()  # "frozen": its heartbeat stops (as a SIGSTOPped process's threads do)
    assert ranks.exited.acquire(timeout=30) and ranks.exited.acquire(timeout=30), ranks.lines  # both live ranks
    for heartbeat in ranks.ranks:
        heartbeat.stop()
    assert sorted(rank for rank, _ in ranks.exits) == [0, 1] and {s for _, s in ranks.exits} == {HUNG_EXIT_STATUS}
    assert {line for _, line in ranks.lines} == {
        "error: hung: rank 2 stopped responding (no heartbeat for 1 s: the process is stopped, frozen or gone); "
        "no step after step 7 finished in 1 s (distributed.timeout_s); exiting with status 4 so the job restarts "
        "from its newest checkpoint"}


def test_a_stuck_run_whose_ranks_are_alive_says_where_they_wait():
    ranks = _Ranks(2, timeout_s=1.0, interval_s=0.4)
    for heartbeat in ranks.ranks:
        heartbeat.start()
        heartbeat.beat(3)
    assert ranks.exited.acquire(timeout=30) and ranks.exited.acquire(timeout=30), ranks.lines  # waits here
    for heartbeat in ranks.ranks:
        heartbeat.stop()
    (line,) = {line for _, line in ranks.lines}
    assert line.startswith("error: hung: every rank is alive but no step after step 3 finished in 1 s "
                           "(distributed.timeout_s): ")
    assert "a deadlock, or a step slower than the timeout (ranks 0, 1 in tests/core/test_reliability_hang.py:" in line
    assert "(test_a_stuck_run_whose_ranks_are_alive_says_where_they_wait)" in line


def test_nothing_fires_before_the_first_beat_or_after_stop():
    ranks = _Ranks(2, timeout_s=0.5, interval_s=0.1)
    for heartbeat in ranks.ranks:
        heartbeat.start()  # started, never beaten: start-up is not a step
    assert not ranks.exited.acquire(timeout=1.5)
    for heartbeat in ranks.ranks:
        heartbeat.beat(1)
        heartbeat.stop()  # training ended
    assert not ranks.exited.acquire(timeout=1.5) and ranks.lines == []


def test_stop_waits_for_a_store_write_in_flight():
    """A heartbeat thread left inside the store's C++ call when the interpreter finalises aborts the process after a
    finished run (seen in CI: "terminate called without an active exception", exit 134). ``stop`` returns only
    once both threads are gone, waiting for the write in flight."""
    entered, release = threading.Event(), threading.Event()
    writes: list[str] = []

    class SlowStore:
        def set(self, key: str, value: str) -> None:
            entered.set()
            release.wait(10)
            writes.append(key)

    heartbeat = Heartbeat(lambda timeout: SlowStore(), 0, 1, 60.0, interval_s=1.0, report=print, exit=lambda s: None)
    heartbeat.start()
    assert entered.wait(10)
    threading.Timer(0.5, release.set).start()
    heartbeat.stop()
    assert writes == ["rank-0"]  # the write returned before stop did
    assert not [t for t in threading.enumerate() if t.name in ("loongforge-heartbeat", "loongforge-watchdog")]


def test_the_timeout_is_checked_and_the_flag_sets_it(tmp_path, capsys):
    assert main(["check", QUICKSTART, "distributed.timeout_s=0"]) == 2
    assert capsys.readouterr().err.strip().endswith("distributed.timeout_s must be an integer >= 1, got 0")
    assert main(["train", QUICKSTART, "--dist-timeout", "-5", f"run.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().endswith("distributed.timeout_s must be an integer >= 1, got -5")


def test_the_launcher_kills_a_stopped_worker_it_is_ending_and_no_other():
    """torch's launcher ends the other ranks with SIGTERM and waits 30 s before SIGKILL; a stopped process cannot act
    on SIGTERM, so that wait was pure loss after a hang. A stopped process with no such signal pending is left."""
    ending, paused = (subprocess.Popen(["sleep", "120"]) for _ in range(2))
    try:
        with _killing_stopped_workers():
            for worker in (ending, paused):
                worker.send_signal(signal.SIGSTOP)
                while psutil.Process(worker.pid).status() != psutil.STATUS_STOPPED:
                    threading.Event().wait(0.05)
            ending.send_signal(signal.SIGTERM)  # what torch's launcher sends
            assert ending.wait(timeout=30) == -signal.SIGKILL
            threading.Event().wait(1.5)  # three looks at the children
            assert paused.poll() is None
    finally:
        for worker in (ending, paused):
            worker.kill()
            worker.wait()
