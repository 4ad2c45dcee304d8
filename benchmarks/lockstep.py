"""Benchmark sides in processes of their own that take turns, a few steps at a time: the machine's drift cancels.

Why: on a shared 2-core host the speed of the same code drifts by 10-20% within minutes (other tenants, clocks).
Sides timed one process after the other then see different machines, and the ratio between two sides moves more
than the differences it is meant to show. Here the worker processes of all sides are alive at once and a baton,
passed through pipes, lets exactly one of them run at a time: side A runs its turn (``k`` steps), then side B,
then A again... Each turn of every side is measured within a second of the other sides' turn, and the ratio of two
sides taken turn by turn (:func:`paired_ratio`) cancels the drift. A waiting worker is blocked in a pipe read and
uses no CPU; each side still has its own process, so its peak RSS and time to first step are its own.

Start-up is not interleaved: the parent starts the workers one at a time and lets each run its first turn before
it starts the next (the others already started wait meanwhile), so imports, model build and compilation happen with
the machine to themselves. Exits are one at a time too: after its last turn a worker waits for the parent's word
(:meth:`Baton.wait_to_finish`) before it tears down.

The protocol, for a worker: ``baton.take()`` before each turn, ``baton.give_back()`` after it, and
``baton.wait_to_finish()`` after the last one, before it prints its result (one JSON line, the last of its stdout).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: Environment variable through which a worker learns its two pipe ends: ``"<read fd>,<write fd>"``.
BATON_VARIABLE = "LOONGFORGE_BENCH_BATON"
_TOKEN = b"."


class Baton:
    """A worker's end of the baton: it runs only between :meth:`take` and :meth:`give_back`."""

    def __init__(self, turn_fd: int, done_fd: int) -> None:
        self._turn_fd = turn_fd
        self._done_fd = done_fd

    @classmethod
    def from_environment(cls) -> Baton:
        value = os.environ.get(BATON_VARIABLE)
        if not value:
            raise SystemExit(f"a benchmark worker runs under its parent ({BATON_VARIABLE} is not set)")
        turn_fd, done_fd = (int(fd) for fd in value.split(","))
        return cls(turn_fd, done_fd)

    def take(self) -> None:
        """Block until it is this worker's turn."""
        if os.read(self._turn_fd, 1) != _TOKEN:
            raise SystemExit("the benchmark's parent went away")

    def give_back(self) -> None:
        """End this worker's turn."""
        os.write(self._done_fd, _TOKEN)

    def wait_to_finish(self) -> None:
        """After the last turn: block until the parent lets this worker tear down and exit."""
        self.take()


class _Worker:
    """The parent's end of one side's worker process (output in files: a full pipe would stall the worker)."""

    def __init__(self, name: str, command: Sequence[str], env: dict[str, str], scratch: Path) -> None:
        self.name = name
        self._closed = False
        turn_read, self._turn_write = os.pipe()
        self._done_read, done_write = os.pipe()
        self._stdout = open(scratch / f"{name}.out", "w+", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        self._stderr = open(scratch / f"{name}.err", "w+", encoding="utf-8")  # noqa: SIM115
        self._process = subprocess.Popen(
            list(command), stdout=self._stdout, stderr=self._stderr, pass_fds=(turn_read, done_write),
            env={**env, BATON_VARIABLE: f"{turn_read},{done_write}"})
        os.close(turn_read)  # the worker's ends: closed here, so a dead worker reads as end of file
        os.close(done_write)

    def _failure(self, what: str) -> SystemExit:
        self._process.kill()
        self._process.wait()
        self._stderr.seek(0)
        return SystemExit(f"side {self.name} {what} (exit {self._process.returncode}):\n{self._stderr.read()[-3000:]}")

    def turn(self) -> None:
        """Let the worker run one turn and wait until it has."""
        try:
            os.write(self._turn_write, _TOKEN)
        except BrokenPipeError:
            raise self._failure("failed") from None
        if os.read(self._done_read, 1) != _TOKEN:
            raise self._failure("failed")

    def finish(self) -> dict:
        """Let the worker exit; its result (the last line of its stdout)."""
        try:
            os.write(self._turn_write, _TOKEN)
        except BrokenPipeError:
            pass  # already exiting: its exit status says how it went
        returncode = self._process.wait()
        if returncode != 0:
            raise self._failure("failed")
        self._stdout.seek(0)
        lines = self._stdout.read().strip().splitlines()
        self.close()
        if not lines:
            raise SystemExit(f"side {self.name} printed no result")
        return json.loads(lines[-1])

    def close(self) -> None:
        """Kill the worker if it still runs; close the parent's pipe ends and files (once)."""
        if self._closed:
            return
        self._closed = True
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        os.close(self._turn_write)
        os.close(self._done_read)
        self._stdout.close()
        self._stderr.close()


def run_in_lockstep(commands: dict[str, Sequence[str]], turns: int, env: dict[str, str] | None = None,
                    ) -> dict[str, dict]:
    """Run one worker per side (``commands``: side name -> command line), each for ``turns`` turns, in turn, in the
    given order; every side's result. Start-up is one side at a time (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    workers: list[_Worker] = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for name, command in commands.items():
                workers.append(_Worker(name, command, env, Path(scratch)))
                workers[-1].turn()  # its first turn, while the machine is its own
            for _ in range(turns - 1):
                for worker in workers:
                    worker.turn()
            return {worker.name: worker.finish() for worker in workers}
        finally:
            for worker in workers:
                worker.close()


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over turns of ``numerator[t] / denominator[t]``: two sides' ratio taken turn by turn, where the
    machine was the same for both (values per turn, e.g. step times, in the same units)."""
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))
