"""Runs a malformed input through ``loongforge check`` and ``loongforge train`` in this process and says what a user
would have seen: a one-line refusal, a traceback, a hang, or an accepted run.

In-process (``loongforge.cli.main``) rather than a subprocess per run: a run that is refused costs milliseconds,
where starting Python and importing torch would cost seconds, so the whole generated set can go through both
commands. Each run is judged on the captured file descriptors (``capfd``), so a traceback printed by any layer is
seen, and it runs under a wall-clock alarm (:data:`LIMIT_S`): a run that does not finish is stopped and counted as a
hang instead of stopping the suite.

``train`` of a malformed config must refuse in pre-flight, before any optimization, process group or model exists.
:func:`run` makes that observable: unless a case says otherwise, the first step after pre-flight
(``loongforge.train.run._validate`` returning) raises :class:`PastPreflight`, and the run counts as accepted. So a
config that slipped through costs no model build and no training, and still fails the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Wall-clock seconds one command may take before it counts as a hang (generous: the CI machine is shared; a
#: refused run takes milliseconds, a LeRobot case's train about a tenth of a second).
LIMIT_S = 60.0
COMMANDS = ("check", "train")


@dataclass(frozen=True)
class Case:
    """One malformed input: ``argv`` after the command (the config and overrides), run in ``workdir``.

    ``expect``: text the error line must contain (the config file, the data file and line, the key).
    ``before_model``: ``train`` must refuse in pre-flight (see the module docstring); ``False`` for inputs whose
    checks a plugin runs later in training (the LeRobot cases), which then run for real.
    """

    name: str
    argv: tuple[str, ...]
    workdir: Path
    expect: tuple[str, ...] = ()
    before_model: bool = True


@dataclass
class Outcome:
    """What one command did with one case."""

    case: Case
    command: str
    code: int | None = None
    out: str = ""
    err: str = ""
    hung: bool = False
    past_preflight: bool = False
    raised: str | None = None  # an exception that escaped main(): a traceback for the user
    seconds: float = 0.0
    wrote: list[str] = field(default_factory=list)

    @property
    def traceback(self) -> bool:
        return self.raised is not None or "Traceback (most recent call last)" in self.out + self.err

    @property
    def accepted(self) -> bool:
        return self.past_preflight or self.code == 0

    @property
    def error_line(self) -> str | None:
        lines = self.err.splitlines()
        return lines[0] if len(lines) == 1 and lines[0].startswith("error: ") else None

    def problem(self) -> str | None:
        """Why this outcome is not a clean refusal (``None`` when it is)."""
        if self.hung:
            return f"hung (no answer in {LIMIT_S:.0f} s)"
        if self.traceback:
            return f"traceback: {self.raised or self.err.strip().splitlines()[-1]}"
        if self.accepted:
            return "accepted" + (" (train got past pre-flight)" if self.past_preflight else f" (exit {self.code})")
        if self.code != 2 or self.error_line is None:
            return f"exit {self.code}, stderr not one 'error:' line: {self.err.strip()[:300]!r}"
        missing = [text for text in self.case.expect if text not in self.error_line]
        if missing:
            return f"error line does not name {missing}: {self.error_line}"
        if self.wrote:
            return f"refused, but wrote {self.wrote} first"
        return None


class PastPreflight(BaseException):
    """Raised by the guard right after ``train``'s pre-flight passed (a BaseException: no handler swallows it)."""


class Hung(BaseException):
    """Raised by the alarm when a command runs past :data:`LIMIT_S`."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Hung

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _stop_after_preflight(active: bool) -> Iterator[None]:
    """While active, ``train`` raises :class:`PastPreflight` as soon as its pre-flight has passed."""
    if not active:
        yield
        return
    import loongforge.train.run as run_module

    validate = run_module._validate

    def validate_then_stop(*args: Any, **kwargs: Any) -> None:
        validate(*args, **kwargs)
        raise PastPreflight

    run_module._validate = validate_then_stop
    try:
        yield
    finally:
        run_module._validate = validate


def run(case: Case, command: str, capfd: Any) -> Outcome:
    """``loongforge COMMAND *case.argv`` in ``case.workdir``, judged (see :meth:`Outcome.problem`)."""
    from loongforge.cli import main

    outcome = Outcome(case, command)
    before = set(os.listdir(case.workdir))
    capfd.readouterr()
    start = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(case.workdir)
    try:
        with _alarm(LIMIT_S), _stop_after_preflight(case.before_model and command == "train"):
            outcome.code = main([command, *case.argv])
    except PastPreflight:
        outcome.past_preflight = True
    except Hung:
        outcome.hung = True
    except Exception as exc:  # noqa: BLE001 -- escaping main() is what a user sees as a traceback
        outcome.raised = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        os.chdir(cwd)
        outcome.seconds = time.perf_counter() - start
        outcome.out, outcome.err = capfd.readouterr()
    if case.before_model:
        outcome.wrote = sorted(set(os.listdir(case.workdir)) - before)
    return outcome


def run_all(cases: Sequence[Case], capfd: Any) -> list[Outcome]:
    """Every case through every command of :data:`COMMANDS`."""
    return [run(case, command, capfd) for case in cases for command in COMMANDS]


def summary(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Counts of runs, tracebacks, hangs, accepted runs and other badly reported refusals."""
    problems = [o for o in outcomes if o.problem() is not None]
    return {
        "runs": len(outcomes),
        "tracebacks": sum(o.traceback and not o.hung for o in outcomes),
        "hangs": sum(o.hung for o in outcomes),
        "accepted": sum(o.accepted and not o.traceback and not o.hung for o in outcomes),
        "badly_reported": sum(not (o.hung or o.traceback or o.accepted) for o in problems),
    }


def failures(outcomes: Sequence[Outcome], limit: int = 25) -> str:
    """The first ``limit`` problems, one line each, for an assertion message."""
    lines = [f"{o.case.name} [{o.command}]: {o.problem()}" for o in outcomes if o.problem() is not None]
    shown = "\n".join(lines[:limit])
    return shown + (f"\n... and {len(lines) - limit} more" if len(lines) > limit else "")
