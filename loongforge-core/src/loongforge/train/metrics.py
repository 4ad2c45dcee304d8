"""Metrics sinks: ``<output_dir>/metrics.jsonl`` and TensorBoard, written by rank 0 only.

Every step gets a JSON line with the exact loss (``repr`` round-trips a float), which is what the resume
test compares bit-for-bit; a NaN or infinite value is written as ``null`` so every line is valid JSON. Lines are
buffered and flushed every ``logging.interval`` steps so the training loop does no per-step file I/O, and synced to
disk before each checkpoint is saved (:meth:`MetricsWriter.sync`): a run killed after a save has every line up to
the saved step, so its resume (which drops lines past the checkpoint) leaves neither holes nor duplicates.
TensorBoard gets what the loop logs at logging steps: the values averaged over the interval
(:mod:`loongforge.train.loop`), under ``train/<name>``; an evaluation's numbers go under ``val/<name>`` at the step
evaluated.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Append per-step metrics to JSONL and TensorBoard; a no-op on ranks other than 0."""

    def __init__(
        self, output_dir: str | Path, *, rank: int, jsonl: bool, tensorboard: bool, start_step: int = 0
    ) -> None:
        self.output_dir = Path(output_dir)
        self._jsonl = None
        self._tb = None
        if rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._drop_steps_after(start_step)
            self._jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    @property
    def jsonl_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        return self.output_dir / "tensorboard"

    def _drop_steps_after(self, step: int) -> None:
        """On resume, forget lines a killed run wrote past the checkpoint so each step appears once."""
        path = self.jsonl_path
        if not path.is_file():
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if _step_of(line) <= step]
        path.write_text("".join(kept), encoding="utf-8")

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Buffer one step's metrics (numbers only go to TensorBoard; everything JSON-able to the JSONL)."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_json_safe({"step": step, **metrics}), allow_nan=False) + "\n")

    def log(self, step: int, metrics: dict[str, Any], *, group: str = "train") -> None:
        """A logging-interval step (or an evaluation, ``group="val"``): write ``metrics``' numbers to TensorBoard as
        ``<group>/<name>`` and flush both sinks."""
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{group}/{key}", value, step)
        self._flush()

    def sync(self) -> None:
        """Everything recorded so far onto disk (called right before a checkpoint is saved)."""
        self._flush()
        if self._jsonl is not None:
            os.fsync(self._jsonl.fileno())

    def _flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _json_safe(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by ``None`` (JSON has no such numbers; ``null`` parses)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a killed run
