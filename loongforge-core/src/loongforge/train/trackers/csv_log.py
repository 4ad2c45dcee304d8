"""The ``csv`` tracker: ``<output_dir>/metrics.csv``, one row per logging step, a ``step`` column and one column
per tag (``train/loss``, ``val/loss`` ...), for spreadsheets and scripts.

Why rows wait for :meth:`CsvTracker.flush`: an evaluation and the interval's averages of the same step arrive as
two calls and belong in one row. New tags (``val/*`` first appear at the first evaluation) widen the header, so
the file is rewritten then -- once per new column, not per row; every other flush appends. A resumed run first
drops the rows a killed run wrote past its checkpoint, as ``metrics.jsonl`` does. Pictures are ignored.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from loongforge.train.trackers import Scalar, Tracker

if TYPE_CHECKING:
    from loongforge.config.schema import LoggingConfig


class CsvTracker(Tracker):
    def __init__(self, output_dir: Path, logging: LoggingConfig, *, start_step: int) -> None:
        self.path = output_dir / "metrics.csv"
        self.location = str(self.path)
        self._columns: list[str] = []
        self._pending: dict[int, dict[str, float]] = {}
        if self.path.is_file():
            with open(self.path, newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                self._columns = [name for name in reader.fieldnames or [] if name != "step"]
                kept = [row for row in reader if _step(row) <= start_step]
            self._write(kept, mode="w")

    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        row = self._pending.setdefault(step, {})
        row.update({f"{group}/{name}": value for name, value in values.items()})

    def hparams(self, params: Mapping[str, Scalar]) -> None:
        return None  # the resolved config is config.yaml beside the checkpoints

    def flush(self) -> None:
        if not self._pending:
            return
        rows = [{"step": step, **values} for step, values in sorted(self._pending.items())]
        self._pending = {}
        added = [name for row in rows for name in row if name != "step" and name not in self._columns]
        if added:
            earlier = []
            if self.path.is_file():
                with open(self.path, newline="", encoding="utf-8") as handle:
                    earlier = list(csv.DictReader(handle))
            self._columns += list(dict.fromkeys(added))
            self._write(earlier + rows, mode="w")
        else:
            self._write(rows, mode="a")

    def _write(self, rows: list[Mapping[str, object]], *, mode: str) -> None:
        """Append ``rows`` (``mode="a"``) or replace the file with them and the header (``"w"``, via a temporary
        file, so a crash mid-rewrite leaves the old file)."""
        target = self.path if mode == "a" else self.path.with_suffix(".csv.tmp")
        with open(target, mode, newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["step", *self._columns], restval="")
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)
        if mode == "w":
            os.replace(target, self.path)

    def close(self) -> None:
        self.flush()


def _step(row: Mapping[str, str]) -> float:
    try:
        return int(row["step"])
    except (KeyError, TypeError, ValueError):
        return float("inf")  # a torn last row from a killed run
