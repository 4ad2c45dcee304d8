"""Metrics sinks: ``<output_dir>/metrics.jsonl`` and the experiment trackers, written by rank 0 only.

Every step gets a JSON line with the exact loss (``repr`` round-trips a float), which is what the resume
test compares bit-for-bit; a NaN or infinite value is written as ``null`` so every line is valid JSON. Lines are
buffered and flushed every ``logging.interval`` steps so the training loop does no per-step file I/O, and synced to
disk before each checkpoint is saved (:meth:`MetricsWriter.sync`): a run killed after a save has every line up to
the saved step, so its resume (which drops lines past the checkpoint) leaves neither holes nor duplicates.
The experiment trackers of ``logging.trackers`` (:mod:`loongforge.train.trackers`: TensorBoard, W&B, MLflow, CSV)
get what the loop logs at logging steps: the values averaged over the interval (:mod:`loongforge.train.loop`),
under ``train/<name>``; an evaluation's numbers go under ``val/<name>`` at the step evaluated.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from loongforge.train.trackers import Trackers


class MetricsWriter:
    """Append per-step metrics to JSONL and log interval values to the run's trackers; a no-op on ranks other
    than 0 (which get no trackers)."""

    def __init__(
        self, output_dir: str | Path, *, rank: int, jsonl: bool, trackers: Trackers | None = None, start_step: int = 0
    ) -> None:
        self.output_dir = Path(output_dir)
        self.trackers = trackers if trackers is not None and rank == 0 else Trackers()
        self._jsonl = None
        if rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._drop_steps_after(start_step)
            self._jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")

    @property
    def jsonl_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def _drop_steps_after(self, step: int) -> None:
        """On resume, forget lines a killed run wrote past the checkpoint so each step appears once."""
        path = self.jsonl_path
        if not path.is_file():
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if _step_of(line) <= step]
        path.write_text("".join(kept), encoding="utf-8")

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Buffer one step's metrics (everything JSON-able) as a JSONL line."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_json_safe({"step": step, **metrics}), allow_nan=False) + "\n")

    def hparams(self, config: dict[str, Any]) -> None:
        """The resolved config (``config_to_dict``) as the trackers' hyper-parameters, once when the run starts."""
        self.trackers.hparams(config)

    def log(self, step: int, metrics: dict[str, Any], *, group: str = "train") -> None:
        """``metrics``' numbers to the trackers as ``<group>/<name>``. A ``train`` call (a logging step) also
        flushes every sink; a ``val`` call (an evaluation) waits for it, so that a step's evaluation and averages
        reach a tracker together (one CSV row)."""
        numbers = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if numbers:
            self.trackers.scalars(step, numbers, group)
        if group == "train":
            self._flush()

    def sync(self) -> None:
        """Everything recorded so far onto disk (called right before a checkpoint is saved)."""
        self._flush()
        if self._jsonl is not None:
            os.fsync(self._jsonl.fileno())

    def _flush(self) -> None:
        self.trackers.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self.trackers.close()


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
