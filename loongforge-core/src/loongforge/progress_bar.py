"""The rich bar of :mod:`loongforge.progress` (imported only when a terminal shows one).

Why a layout of its own: rich shares a narrow terminal among a bar's columns by shrinking the widest, so a long note
(a tensor's name) used to squeeze the count and the time left out of an 80-column line ("converting ten… 50,701.05
tens…"). Here the count, the elapsed time and the time left never shrink; the description, the bar, the rate and the
note give up their width first, cut with an ellipsis on one line rather than wrapped onto two.
"""

from __future__ import annotations

from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text


class _Yielding(ProgressColumn):
    """A text field that a narrow terminal may cut (with an ellipsis, never onto a second line)."""

    def __init__(self, field: str, style: str = "") -> None:
        super().__init__(table_column=Column(no_wrap=False))
        self.field, self.style = field, style

    def render(self, task: Task) -> Text:
        value = task.description if self.field == "description" else task.fields[self.field]
        return Text(value, style=self.style, no_wrap=True, overflow="ellipsis")


def _kept() -> Column:
    """A column that keeps its full width however narrow the terminal."""
    return Column(no_wrap=True)


def job_bar(description: str, total: int | None, *, byte_counts: bool, stream: TextIO) -> tuple[Progress, TaskID]:
    """A started bar showing ``description``'s progress on ``stream``, and its task."""
    count = DownloadColumn(table_column=_kept()) if byte_counts else MofNCompleteColumn(table_column=_kept())
    bar = Progress(
        _Yielding("description", "bold"), BarColumn(bar_width=20), count, _Yielding("rate"),
        TimeElapsedColumn(table_column=_kept()), TextColumn("eta", table_column=_kept()),
        TimeRemainingColumn(table_column=_kept()), _Yielding("note"),
        transient=False, console=Console(file=stream),
    )
    task = bar.add_task(description, total=total, rate="", note="")
    bar.start()
    return bar, task
