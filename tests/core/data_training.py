"""A short ``loongforge train`` on a tiny model, as a user runs it: what the data tests check "it trains" with.

The text is the opening of the shipped *Pride and Prejudice* (real prose, so a few steps visibly lower the loss),
cut into its paragraphs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from loongforge.data.shipped import shipped_corpus_files

STEPS = 12


def paragraphs(count: int = 300) -> list[str]:
    """The first ``count`` paragraphs of the shipped novel."""
    text = next(p for p in shipped_corpus_files() if p.name.startswith("pride")).read_text(encoding="utf-8")
    found = [block.strip() for block in text.split("\n\n") if block.strip()]
    return found[:count]


def train_losses(tmp_path: Path, data: dict[str, Any], **training: Any) -> list[float]:
    """Train ``llama-debug`` for :data:`STEPS` steps on the ``data:`` section (and ``training`` keys) with the CLI;
    the per-step losses."""
    config = {
        "model": {"name": "llama-debug"},
        "data": {"seq_length": 64, **data},
        "training": {"steps": STEPS, "micro_batch_size": 4, "threads": 1, **training},
        "optimizer": {"lr": 0.003},
        "scheduler": {"warmup_steps": 2},
        "checkpoint": {"save_at_end": False, "interval": 0},
        "logging": {"progress": False, "tensorboard": False},
        "run": {"output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(path), "--device", "cpu"],
                            capture_output=True, text=True, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses
    return losses


def assert_learns(losses: list[float]) -> None:
    """Finite and falling: the last three steps average well below the first three."""
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, (first, last, losses)


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "LOONGFORGE_CACHE_DIR": str(tmp_path / "cache"), "HF_DATASETS_CACHE": str(tmp_path / "hf")}
