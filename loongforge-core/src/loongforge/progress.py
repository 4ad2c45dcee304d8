"""Progress of long jobs other than training: conversion, generation, sampling, evaluation, data collection,
latent caching, checkpoint saving and verifying.

Why one helper: a user watching ``loongforge convert`` or ``loongforge sample`` should see the same thing as for
any other long job -- what is being done, how far it got, the rate and the time left -- and CI logs should get a few
greppable plain lines instead of terminal control codes. On a terminal this draws a rich bar (description, done /
total, rate, elapsed, ETA); elsewhere (stdout not a TTY, or ``LOONGFORGE_PROGRESS=plain``) it prints
``<description>: <done>/<total> <unit> (<rate>/s, eta <s>s)`` at most every ``plain_every`` seconds plus a final
line. ``LOONGFORGE_PROGRESS=off`` silences both. Only rank 0 (``RANK`` unset or 0) shows anything, so a
multi-process job prints once. A command whose standard output is its product (``loongforge generate --jsonl``)
passes ``stderr=True``, so the progress never mixes into what a pipe reads. A job counted in ``unit="bytes"``
(tokenizing text files) shows sizes and rates in kB/MB/GB rather than raw byte counts.

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
from typing import TextIO, TypeVar

T = TypeVar("T")

#: Seconds between two plain progress lines (non-TTY).
PLAIN_EVERY_S = 10.0
#: The unit whose counts are shown as sizes (decimal, as rich's download columns show them).
BYTES = "bytes"


def _size(count: float) -> str:
    """``count`` bytes in the largest decimal unit (up to TB) that keeps it >= 1: ``512 B``, ``52.4 MB``."""
    units = ("B", "kB", "MB", "GB", "TB")
    index = 0
    while count >= 1000 and index < len(units) - 1:
        count /= 1000
        index += 1
    return f"{count:,.0f} B" if index == 0 else f"{count:,.1f} {units[index]}"


def progress_mode(stream: TextIO) -> str:
    """``rich``, ``plain`` or ``off`` for this process, showing on ``stream`` (training's display asks too)."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return "off"
    forced = os.environ.get("LOONGFORGE_PROGRESS", "").strip().lower()
    if forced in ("off", "plain", "rich"):
        return forced
    return "rich" if stream.isatty() else "plain"


class JobProgress:
    """A running job's progress; made by :func:`job_progress`. ``total`` may be ``None`` (unknown length)."""

    def __init__(self, description: str, total: int | None, unit: str, mode: str, plain_every: float,
                 stream: TextIO | None = None) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0
        self.note = ""
        self._mode = mode
        self._plain_every = plain_every
        self._stream = stream if stream is not None else sys.stdout
        self._start = time.perf_counter()
        self._last_line = self._start
        self._last_shown: int | None = None  # ``done`` when the last plain line was printed
        self._bar = None
        self._task = None
        if mode == "rich":
            from loongforge.progress_bar import job_bar  # rich is imported only for the bar

            self._bar, self._task = job_bar(description, total, byte_counts=unit == BYTES, stream=self._stream)

    def advance(self, n: int = 1, *, note: str = "") -> None:
        """``n`` more units done; ``note`` (optional) says what the latest one was (a tensor's name, a prompt)."""
        self.done += n
        if note:
            self.note = note
        if self._bar is not None:
            self._bar.update(self._task, advance=n, rate=self._rate_text(), note=self.note)
        elif self._mode == "plain":
            now = time.perf_counter()
            if now - self._last_line >= self._plain_every:
                self._last_line = now
                self._print_line()

    def message(self, text: str) -> None:
        """A line of text above the bar (or plainly); nothing when progress is off."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        elif self._mode == "plain":
            print(text, file=self._stream, flush=True)

    def rate(self) -> float:
        elapsed = time.perf_counter() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def _rate_text(self) -> str:
        return f"{_size(self.rate())}/s" if self.unit == BYTES else f"{self.rate():,.2f} {self.unit}/s"

    def line(self) -> str:
        """The plain-text status line: done/total, rate, ETA (or elapsed once finished / when total is unknown)."""
        rate = self.rate()
        elapsed = time.perf_counter() - self._start
        if self.total is not None and self.done < self.total and rate > 0:
            tail = f"eta {(self.total - self.done) / rate:.0f}s"
        else:
            tail = f"{elapsed:.1f}s"
        note = f" [{self.note}]" if self.note else ""
        if self.unit == BYTES:
            count = _size(self.done) if self.total is None else f"{_size(self.done)}/{_size(self.total)}"
            return f"{self.description}: {count} ({self._rate_text()}, {tail}){note}"
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        return f"{self.description}: {count} {self.unit} ({rate:,.2f}/s, {tail}){note}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._mode == "plain" and self._last_shown != self.done:  # the final line, unless just printed
            self._print_line()

    def _print_line(self) -> None:
        self._last_shown = self.done
        print(self.line(), file=self._stream, flush=True)


@contextmanager
def job_progress(description: str, total: int | None = None, *, unit: str = "item",
                 plain_every: float | None = None, stderr: bool = False) -> Iterator[JobProgress]:
    """Show ``description``'s progress while the ``with`` body runs (see the module docstring for the modes);
    ``plain_every`` defaults to :data:`PLAIN_EVERY_S` as it is when the job starts; ``stderr`` shows it there."""
    stream = sys.stderr if stderr else sys.stdout
    progress = JobProgress(description, total, unit, progress_mode(stream), PLAIN_EVERY_S if plain_every is None
                           else plain_every, stream)
    try:
        yield progress
    finally:
        progress.close()


def track(items: Iterable[T], description: str, *, total: int | None = None, unit: str = "item",
          stderr: bool = False) -> Iterator[T]:
    """Iterate ``items`` with a progress display; ``total`` defaults to ``len(items)`` when it has one."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with job_progress(description, total, unit=unit, stderr=stderr) as progress:
        for item in items:
            yield item
            progress.advance()
