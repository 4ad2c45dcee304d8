"""VLM DPO at tp=2, pp=2 and dp=2 equals one process: every step's loss, gradient norm and ``dpo/*`` metrics and the
held-out numbers within 1e-5, through the real CLI (``--nproc 2``).

What the layouts add to the text case (tests/core/test_dpo_parallel.py): the encoder and projector are replicated in
front of a decoder split over tensor-parallel ranks; at pp=2 they sit on the first stage with the embedding, each
row's image enters there and the last stage scores the pair (megatron ties the first stage's embedding to the last
stage's output layer through the model's ``pre_process`` / ``shared_embedding_or_output_weight``). The run starts
from the seed's weights on the generated shapes pairs; its reference is their frozen copy.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("model.load=null", "training.steps=4", "training.micro_batch_size=4", "training.global_batch_size=8",
            "scheduler.warmup_steps=1", "optimizer.lr=2e-3", "evaluation.interval=4", "evaluation.steps=2",
            "checkpoint.save_at_end=false", "logging.interval=1", "logging.progress=false",
            "logging.tensorboard=false", "training.threads=1")
COMPARED = ("loss", "grad_norm", "dpo/accuracy", "dpo/reward_margin", "dpo/chosen_logp", "dpo/rejected_logp",
            "val_loss", "val_dpo/accuracy", "val_dpo/reward_margin")
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}


def _train(out: Path, *overrides: str, nproc: int = 1) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "loongforge.cli", "train", str(ROOT / "configs" / "vlm-dpo-shapes.yaml"),
           f"run.output_dir={out}", *SETTINGS, *overrides, *(["--nproc", str(nproc)] if nproc > 1 else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("vlm-dpo-single") / "run")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(tmp_path, single, layout):
    rows = _train(tmp_path / "run", *LAYOUTS[layout], nproc=2)
    assert single[1]["loss"] == math.log(2) and abs(single[4]["loss"] - math.log(2)) > 1e-3  # it trains
    assert sorted(rows) == sorted(single) == [1, 2, 3, 4]
    for step, row in rows.items():
        for key in COMPARED:
            if key in single[step]:
                assert math.isclose(row[key], single[step][key], rel_tol=1e-5, abs_tol=1e-7), (
                    step, key, row[key], single[step][key])
