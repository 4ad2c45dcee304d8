"""Evaluation during training of a composed VLM (configs/vlm-shapes.yaml made tiny): the megatron engine evaluates
the held-out image-text rows with their pixels, and ``val_loss`` at a step equals the answer-token cross-entropy of
that step's checkpoint recomputed here from its logits; the val rows and TensorBoard tags appear at the configured
steps, and the training losses are those of the same run without evaluation, bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from loongforge import load_config

pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
TINY = ["logging.progress=false", "training.threads=1", "data.seq_length=96", "scheduler.warmup_steps=1",
        "checkpoint.save_at_end=false", "training.micro_batch_size=2", "training.steps=3", "data.valid_fraction=0.05",
        "logging.interval=1"]
GLOBAL_BATCH = 2


def _config(out: Path, *overrides: str):
    return load_config(CONFIG, [f"run.output_dir={out}", *TINY, *overrides])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _recomputed_loss(config, checkpoint: Path, samples: int) -> float:
    """Cross-entropy per answer token of ``checkpoint``'s VLM over the first ``samples`` held-out rows, from its
    logits (images included), with nothing of the training engine's."""
    import torch
    import torch.nn.functional as F
    from loongforge.interop.mcore_checkpoint import load_trained_model
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.plugins import get_host
    from loongforge.resolve import resolve_model_flavor
    from loongforge.train.batches import load_tokenizer, open_dataset, split_dataset

    host = get_host()
    family = resolve_model_flavor(config, host)
    _, rows = split_dataset(open_dataset(host, config, load_tokenizer(host, config), model=family), config)
    batch = rows.batch(np.arange(samples))
    images = {key: batch[key] for key in family.extra_inputs if key in batch}
    assert "pixel_values" in images  # the rows really carry images
    with standalone_world() as backend:
        model = load_trained_model(checkpoint, build_standalone(family, backend), config)
        model.eval()
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), **images)
    vocab = family.decoder.vocab_size
    per_token = F.cross_entropy(logits[..., :vocab].float().reshape(-1, vocab), batch["labels"].reshape(-1),
                                reduction="none")
    mask = batch["loss_mask"].reshape(-1).float()
    return float((per_token * mask).sum() / mask.sum())


def test_vlm_validation_loss_rows_tensorboard_and_recomputation(tmp_path):
    from loongforge.train.run import run_training
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "on"
    config = _config(out, "evaluation.interval=2", "evaluation.steps=2", "checkpoint.interval=2",
                     "logging.tensorboard=true")
    run_training(config, device="cpu")
    rows = _rows(out)
    evaluated = {row["step"]: row for row in rows if "val_loss" in row}
    assert sorted(evaluated) == [2, 3]
    assert all(math.isfinite(row["val_loss"]) and row["val_ppl"] == math.exp(row["val_loss"])
               for row in evaluated.values())
    expected = _recomputed_loss(config, out / "checkpoints" / "step-0000002", 2 * GLOBAL_BATCH)
    assert evaluated[2]["val_loss"] == pytest.approx(expected, rel=1e-6, abs=0)

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"val/loss", "val/ppl"} <= set(events.Tags()["scalars"])
    assert {e.step: e.value for e in events.Scalars("val/loss")} == pytest.approx(
        {s: r["val_loss"] for s, r in evaluated.items()}, rel=1e-6)

    off = tmp_path / "off"
    run_training(_config(off, "logging.tensorboard=false", "checkpoint.interval=2"), device="cpu")
    assert [r["loss"] for r in _rows(off)] == [r["loss"] for r in rows]
