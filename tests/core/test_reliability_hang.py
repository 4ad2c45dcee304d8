"""A rank that stops is found, named and restarted (issue 45, item 3).

Measured on main: with one rank SIGSTOPped the other waited past 250 s -- until gloo's hard-coded 30 minutes --
because no config reached the process groups' timeout, nothing watched for progress, and ``--max-restarts`` reacts
only to a dead process.

Now ``distributed.timeout_s`` (``--dist-timeout``) sets every process group's timeout (the default group, megatron's
groups and any made later; plus the watchdog's time to speak first), and a heartbeat watchdog on each rank ends a
run whose ranks finish no step for that long: it names the rank that stopped and exits with status 4, which
``--max-restarts`` restarts. The end-to-end test freezes rank 1 of a 2-process run with SIGSTOP: the first attempt
ends within the timeout + 60 s with one line naming rank 1, and the restarted processes resume from the newest
checkpoint and finish bit for bit like a run that was never frozen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from example_packages import plugin_site
from loongforge.parallel import distributed as lf_dist
from loongforge.parallel.distributed import HUNG_EXIT_STATUS, Heartbeat, group_timeout_s

ROOT = Path(__file__).resolve().parents[2]


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
    ``exits`` instead of ending the process."""

    def __init__(self, world: int, timeout_s: float, interval_s: float) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        self.lines: list[tuple[int, str]] = []
        self.exits: list[tuple[int, int]] = []
        self.done = threading.Event()
        self.ranks = [Heartbeat(self._connect, rank, world, timeout_s, interval_s=interval_s,
                                report=lambda line, rank=rank: self.lines.append((rank, line)),
                                exit=lambda status, rank=rank: self._exit(rank, status)) for rank in range(world)]

    def _connect(self, timeout: float):
        client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timedelta(seconds=timeout),
                               wait_for_workers=False)
        return dist.PrefixStore("loongforge/attempt-0/heartbeat/", client)

    def _exit(self, rank: int, status: int) -> None:
        self.exits.append((rank, status))
        self.done.set()


def test_the_watchdog_names_the_rank_that_stopped():
    ranks = _Ranks(3, timeout_s=1.0, interval_s=0.2)
    for heartbeat in ranks.ranks:
        heartbeat.start()
        heartbeat.beat(7)
    ranks.ranks[2].stop()  # "frozen": its heartbeat stops (as a SIGSTOPped process's threads do)
    started = time.monotonic()
    assert ranks.done.wait(15), ranks.lines
    assert time.monotonic() - started < 1.0 + 3.0  # the timeout, then a few heartbeats to tell who stopped
    time.sleep(1.5)  # the other live rank reads the same verdict
    for heartbeat in ranks.ranks:
        heartbeat.stop()
    assert sorted(rank for rank, _ in ranks.exits) == [0, 1] and {s for _, s in ranks.exits} == {HUNG_EXIT_STATUS}
    assert {line for _, line in ranks.lines} == {
        "error: hung: rank 2 stopped responding (no heartbeat for 0.5 s: the process is stopped, frozen or gone); "
        "no step after step 7 finished in 1 s (distributed.timeout_s); exiting with status 4 so the job restarts "
        "from its newest checkpoint"}


def test_a_stuck_run_whose_ranks_are_alive_says_where_they_wait():
    ranks = _Ranks(2, timeout_s=1.0, interval_s=0.2)
    for heartbeat in ranks.ranks:
        heartbeat.start()
        heartbeat.beat(3)
    assert ranks.done.wait(15)
    time.sleep(1.5)
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
    assert not ranks.done.wait(1.5)
    for heartbeat in ranks.ranks:
        heartbeat.beat(1)
        heartbeat.stop()  # training ended
    assert not ranks.done.wait(1.5) and ranks.lines == []


CONFIG = """
run: {output_dir: OUT, seed: 7}
model: {name: llama-debug}
data: {seq_length: 64}
optimizer: {lr: 0.001}
scheduler: {warmup_steps: 3}
training: {steps: 8, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {interval: 4, keep_last: 3, resume: auto}
logging: {interval: 4, progress: false, tensorboard: false}
"""

#: Rank 1 stops itself (SIGSTOP) at the end of step FREEZE_AT, once per run (PROBE_DIR/frozen.json, made
#: exclusively, records when); the group that starts after it records when it did (restarted.json).
FREEZER = textwrap.dedent(
    '''
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from loongforge import hookimpl


    def _probe(name):
        return Path(os.environ["PROBE_DIR"]) / name


    @hookimpl
    def loongforge_on_train_start(trainer):
        if "PROBE_DIR" in os.environ and _probe("frozen.json").exists() and trainer.rank == 0:
            _probe("restarted.json").write_text(json.dumps({"time": time.time()}))


    @hookimpl
    def loongforge_on_step_end(step):
        if os.environ.get("FREEZE_AT") != str(step) or os.environ["RANK"] != "1":
            return
        try:
            fd = os.open(_probe("frozen.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:  # the restarted group: frozen once already
            return
        os.write(fd, json.dumps({"time": time.time(), "pid": os.getpid()}).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGSTOP)
    '''
)


def _train(root: Path, name: str, site: Path, *args: str, **env: str) -> tuple[Path, subprocess.CompletedProcess]:
    out = root / name
    (out / "probe").mkdir(parents=True)
    config = root / f"{name}.yaml"
    config.write_text(CONFIG.replace("OUT", str(out)))
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), "--nproc", "2", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1",
                               "PROBE_DIR": str(out / "probe"), **env})
    return out, done


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 9))
    return {row["step"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_frozen_rank_ends_the_attempt_and_the_job_resumes_bit_exactly(tmp_path):
    (tmp_path / "site").mkdir()
    site = plugin_site(tmp_path / "site", "freezer_probe", FREEZER)
    timeout = 10
    straight, done = _train(tmp_path, "straight", site)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, done = _train(tmp_path, "frozen", site, "--max-restarts", "1", "--dist-timeout", str(timeout),
                          FREEZE_AT="6")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]

    hung = [line for line in output.splitlines() if "hung:" in line]
    # rank 0 is inside step 6 (its end-of-step vote) when rank 1 stops: step 5 is the last one both finished
    assert hung == [f"[loongforge] error: hung: rank 1 stopped responding (no heartbeat for 2.5 s: the process is "
                    f"stopped, frozen or gone); no step after step 5 finished in {timeout} s (distributed.timeout_s); "
                    "exiting with status 4 so the job restarts from its newest checkpoint"], output[-5000:]
    assert "[loongforge] rank 0 exited with status 4: restarting the 2 processes (restart 1 of 1)" in output
    probe = frozen / "probe"
    froze_at = json.loads((probe / "frozen.json").read_text())["time"]
    restarted_at = json.loads((probe / "restarted.json").read_text())["time"]
    assert restarted_at - froze_at < timeout + 60, restarted_at - froze_at  # start-up of the new group included
    assert f"resumed from {frozen / 'checkpoints' / 'step-0000004'} at step 4" in output

    reference, rows = _rows(straight), _rows(frozen)
    for step in range(1, 9):
        for key in ("loss", "grad_norm", "lr"):
            assert rows[step][key] == reference[step][key], (step, key)
