"""Short training runs for tests: train a config with overrides and read back its per-step losses.

Why here: comparing two variants of one run (eager vs compiled, one process vs several) is how most behaviour of a
family or an optimization is checked, and each comparison needs the same two steps: run through the public
``run_training`` API, then read ``metrics.jsonl``'s losses in step order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def train(config_path: str | Path, output_dir: str | Path, overrides: list[str]) -> dict[str, Any]:
    """Train ``config_path`` with ``overrides`` into ``output_dir``; the run's summary."""
    from loongforge.config import load_config
    from loongforge.train.run import run_training

    return run_training(load_config(str(config_path), [f"run.output_dir={output_dir}", *overrides]))


def step_losses(run_dir: str | Path) -> list[float]:
    """The loss of every step ``run_dir/metrics.jsonl`` records, in file order (evaluation rows left out)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def quiet_env() -> dict[str, str]:
    """The environment of runs started in processes of their own (certify's, a test's): one thread each (runs side
    by side, e.g. two ranks on two cores, do not oversubscribe) and no progress bars in their captured output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_PROGRESS": "off"}
