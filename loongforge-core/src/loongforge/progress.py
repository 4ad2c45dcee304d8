"""Progress of long jobs other than training: conversion, generation, sampling, evaluation, data collection,
latent caching, checkpoint saving and verifying.

Why one helper: a user watching ``loongforge convert`` or ``loongforge sample`` should see the same thing as for
any other long job -- what is being done, how far it got, the rate and the time left -- and CI logs should get a few
greppable plain lines instead of terminal control codes. On a terminal this draws a rich bar (description, done /
total, rate, elapsed, ETA); elsewhere (stdout not a TTY, or ``LOONGFORGE_PROGRESS=plain``) it prints
``<description>: <done>/<total> <unit> (<rate>/s, eta <s>s)`` at most every ``plain_every`` seconds plus a final
line. ``LOONGFORGE_PROGRESS=off`` silences both. Only rank 0 (``RANK`` unset or 0) shows anything, so a
multi-process job prints once.

Usage::

    with job_progress("converting tensors", total=len(names), unit="tensor") as progress:
        for name in names:
            ...
            progress.advance()            # or progress.advance(n, note="layer 3")

    for episode in track(range(10), "evaluating", unit="episode"):
        ...
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

#: Seconds between two plain progress lines (non-TTY).
PLAIN_EVERY_S = 10.0


def _mode() -> str:
    """``rich``, ``plain`` or ``off`` for this process."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return "off"
    forced = os.environ.get("LOONGFORGE_PROGRESS", "").strip().lower()
    if forced in ("off", "plain", "rich"):
        return forced
    return "rich" if sys.stdout.isatty() else "plain"


class JobProgress:
    """A running job's progress; made by :func:`job_progress`. ``total`` may be ``None`` (unknown length)."""

    def __init__(self, description: str, total: int | None, unit: str, mode: str, plain_every: float) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0
        self.note = ""
        self._mode = mode
        self._plain_every = plain_every
        self._start = time.perf_counter()
        self._last_line = self._start
        self._bar = None
        self._task = None
        if mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"), transient=False,
            )
            self._task = self._bar.add_task(description, total=total, rate="", note="")
            self._bar.start()

    def advance(self, n: int = 1, *, note: str = "") -> None:
        """``n`` more units done; ``note`` (optional) says what the latest one was (a tensor's name, a prompt)."""
        self.done += n
        if note:
            self.note = note
        if self._bar is not None:
            self._bar.update(self._task, advance=n, rate=f"{self.rate():,.2f} {self.unit}/s", note=self.note)
        elif self._mode == "plain":
            now = time.perf_counter()
            if now - self._last_line >= self._plain_every:
                self._last_line = now
                print(self.line(), flush=True)

    def message(self, text: str) -> None:
        """A line of text above the bar (or plainly); nothing when progress is off."""
        if self._bar is not None:
            self._bar.console.print(text)
        elif self._mode == "plain":
            print(text, flush=True)

    def rate(self) -> float:
        elapsed = time.perf_counter() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """The plain-text status line: done/total, rate, ETA (or elapsed once finished / when total is unknown)."""
        rate = self.rate()
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        elapsed = time.perf_counter() - self._start
        if self.total is not None and self.done < self.total and rate > 0:
            tail = f"eta {(self.total - self.done) / rate:.0f}s"
        else:
            tail = f"{elapsed:.1f}s"
        note = f" [{self.note}]" if self.note else ""
        return f"{self.description}: {count} {self.unit} ({rate:,.2f}/s, {tail}){note}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._mode == "plain":
            print(self.line(), flush=True)


@contextmanager
def job_progress(description: str, total: int | None = None, *, unit: str = "item",
                 plain_every: float = PLAIN_EVERY_S) -> Iterator[JobProgress]:
    """Show ``description``'s progress while the ``with`` body runs (see the module docstring for the modes)."""
    progress = JobProgress(description, total, unit, _mode(), plain_every)
    try:
        yield progress
    finally:
        progress.close()


def track(items: Iterable[T], description: str, *, total: int | None = None, unit: str = "item") -> Iterator[T]:
    """Iterate ``items`` with a progress display; ``total`` defaults to ``len(items)`` when it has one."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with job_progress(description, total, unit=unit) as progress:
        for item in items:
            yield item
            progress.advance()
