"""Evaluation during training (``evaluation: {interval, steps, data}``) for megatron-engine language models.

What must hold, each checked against something computed another way:

* ``val_loss`` at step N is the mean cross-entropy per target token of the checkpoint saved at step N over the first
  ``evaluation.steps`` global batches of the validation rows, recomputed here from the checkpoint's weights with
  logits and ``torch.nn.functional.cross_entropy`` -- for pretraining on the held-out split, SFT (loss masks, packed
  rows) and separate files named in ``evaluation.data``; ``val_ppl`` is its exponential;
* the rows carrying ``val_*`` are exactly steps interval, 2 x interval, ..., and the last, and TensorBoard has the
  same numbers under ``val/loss`` and ``val/ppl`` at those steps (and no ``train/val_*``);
* a run with evaluation on trains bit for bit the losses of the same run with it off, and a run stopped and resumed
  with evaluation on continues bit for bit, its evaluations included;
* two data-parallel processes (one torchrun launch) evaluate the same number as one process;
* each bad setting is one line from ``loongforge check``, naming the key and the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from loongforge import hookimpl, load_config

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["logging.progress=false", "logging.interval=2", "training.threads=1", "training.sample_tokens=0",
          "model.overrides.num_layers=1", "training.micro_batch_size=2", "training.global_batch_size=4",
          "optimizer.lr=1e-3", "scheduler.warmup_steps=1", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
#: The training text and the separate validation text of the ``evaluation.data`` case (dataset kind ``text``).
TRAIN_TEXT = "It is a truth universally acknowledged that a single man in possession of a good fortune must be " * 40
VALID_TEXT = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, " * 12
RECIPES = {
    "pretrain-held-out": ("configs/quickstart.yaml", ["data.seq_length=32", "data.valid_fraction=0.002"]),
    "sft-held-out": ("configs/sft-tiny.yaml", ["data.seq_length=128", "data.valid_fraction=0.1"]),
    "pretrain-evaluation-data": ("configs/quickstart.yaml", ["data.seq_length=32", "data.dataset=text"]),
}
#: The training tags every run writes (test_training_loop.py) and the two an evaluating LLM run adds.
TRAIN_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/step_time", "train/samples_per_s",
              "train/tokens_per_s", "train/tflops", "train/mfu"}
VAL_TAGS = {"val/loss", "val/ppl"}


def _config(recipe: str, out: Path, *overrides: str):
    path, extra = RECIPES[recipe]
    if recipe.endswith("evaluation-data"):
        (out.parent / "train.txt").write_text(TRAIN_TEXT)
        (out.parent / "valid.txt").write_text(VALID_TEXT)
        extra = [*extra, f"data.paths=[{out.parent / 'train.txt'}]", f"evaluation.data=[{out.parent / 'valid.txt'}]"]
    return load_config(str(ROOT / path), [f"run.output_dir={out}", *COMMON, *extra, *overrides])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(out: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _recomputed_loss(config, checkpoint: Path, samples: int) -> float:
    """The mean cross-entropy per supervised token of ``checkpoint``'s weights over the first ``samples`` validation
    rows, from logits over the true vocabulary (no schedule, no loss function of the engine's)."""
    import torch
    import torch.nn.functional as F
    from loongforge.interop.mcore_checkpoint import load_trained_model
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.parallel.packed_rows import CU_SEQLENS, attend_packed
    from loongforge.plugins import get_host
    from loongforge.resolve import resolve_model_flavor
    from loongforge.train.batches import load_tokenizer, open_dataset, split_dataset

    host = get_host()
    family = resolve_model_flavor(config, host)
    tokenizer = load_tokenizer(host, config)
    if config.evaluation.data:  # the separate files, all of them
        data = dataclasses.replace(config.data, paths=list(config.evaluation.data), valid_fraction=0.0)
        config = dataclasses.replace(config, data=data)
        rows, _ = split_dataset(open_dataset(host, config, tokenizer, model=family), config)
    else:
        _, rows = split_dataset(open_dataset(host, config, tokenizer, model=family), config)
    batch = rows.batch(np.arange(samples))
    if CU_SEQLENS in batch:  # packed rows: each sample attends only to itself, here through the dense mask
        batch = attend_packed(batch, varlen=False)
    with standalone_world() as backend:
        model = load_trained_model(checkpoint, build_standalone(family, backend), config)
        model.eval()
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
    vocab = family.decoder.vocab_size
    per_token = F.cross_entropy(logits[..., :vocab].float().reshape(-1, vocab), batch["labels"].reshape(-1),
                                reduction="none")
    mask = batch["loss_mask"].reshape(-1).float()
    return float((per_token * mask).sum() / mask.sum())


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_validation_loss_is_the_checkpoints_token_loss_on_the_validation_rows(recipe, tmp_path):
    from loongforge.train.run import run_training

    out = tmp_path / "run"
    config = _config(recipe, out, "training.steps=5", "evaluation.interval=2", "evaluation.steps=2",
                     "checkpoint.interval=2", "checkpoint.keep_last=0", "logging.tensorboard=true")
    summary = run_training(config, device="cpu")

    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]  # one line per step, evaluated or not
    evaluated = {row["step"]: row for row in rows if "val_loss" in row}
    assert sorted(evaluated) == [2, 4, 5]  # every interval and the last step
    assert all("val_ppl" not in row for row in rows if row["step"] not in evaluated)
    for row in evaluated.values():
        assert row["val_ppl"] == math.exp(row["val_loss"])
    assert summary["val_loss"] == evaluated[5]["val_loss"] and summary["val_ppl"] == evaluated[5]["val_ppl"]

    scalars = _scalars(out)
    assert set(scalars) == TRAIN_TAGS | VAL_TAGS
    assert scalars["val/loss"] == pytest.approx({s: r["val_loss"] for s, r in evaluated.items()}, rel=1e-6)
    assert scalars["val/ppl"] == pytest.approx({s: r["val_ppl"] for s, r in evaluated.items()}, rel=1e-6)

    global_batch = 4
    for step in (2, 4):
        expected = _recomputed_loss(config, out / "checkpoints" / f"step-{step:07d}", 2 * global_batch)
        assert evaluated[step]["val_loss"] == pytest.approx(expected, rel=1e-6, abs=0)
    assert evaluated[4]["val_loss"] != evaluated[2]["val_loss"]  # the weights moved in between


class StopAt:
    """Stops the run after step ``at`` (a save at the end follows), as a preempted or interrupted run would."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        trainer.should_stop = step >= self.at


def test_evaluation_leaves_training_bit_exact_and_resumes_bit_exactly(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    def run(name: str, *overrides: str) -> list[dict]:
        out = tmp_path / name
        run_training(_config("pretrain-held-out", out, "training.steps=6", "logging.tensorboard=false",
                             "scheduler.decay_steps=6", "evaluation.steps=2", *overrides), device="cpu")
        return _rows(out)

    off = run("off", "evaluation.interval=0")
    every_step = run("on", "evaluation.interval=1")
    assert [(r["loss"], r["grad_norm"]) for r in every_step] == [(r["loss"], r["grad_norm"]) for r in off]
    assert all("val_loss" not in row for row in off)
    assert all("val_loss" in row for row in every_step)

    stopper = register_plugin(StopAt(3), "stop-at")
    first = run("resumed", "evaluation.interval=2", "checkpoint.save_at_end=true")
    assert [row["step"] for row in first] == [1, 2, 3] and "val_loss" not in first[2]  # stopped: 3 is no cadence step
    stopper.at = 99  # the same command again resumes from step 3 and runs to the end
    rows = run("resumed", "evaluation.interval=2", "checkpoint.save_at_end=true")
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == [r["loss"] for r in off]
    assert {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} == {
        s: every_step[s - 1]["val_loss"] for s in (2, 4, 6)}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_processes_evaluate_what_one_process_does(tmp_path):
    """The same global batches (4 sequences: 2 micro-batches of 2 on one rank, one of 2 on each of two ranks)."""
    from loongforge.train.run import run_training

    one = tmp_path / "one"
    overrides = ["training.steps=2", "evaluation.interval=1", "evaluation.steps=2", "logging.tensorboard=false"]
    run_training(_config("pretrain-held-out", one, *overrides), device="cpu")

    two = tmp_path / "two"
    config = ROOT / RECIPES["pretrain-held-out"][0]
    args = [f"run.output_dir={two}", *COMMON, *RECIPES["pretrain-held-out"][1], *overrides]
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), *args, "--nproc", "2",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp=2" in done.stdout
    single, dual = _rows(one), _rows(two)
    assert [r["step"] for r in dual] == [1, 2]
    for a, b in zip(single, dual, strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-6, abs=0)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["evaluation.interval=-1"], "evaluation.interval must be an integer >= 0 (0 turns evaluation off), got -1"),
    (["evaluation.interval=10", "evaluation.steps=0"], "evaluation.steps must be an integer >= 1, got 0"),
    (["evaluation.interval=10", "data.valid_fraction=0"],
     "evaluation.interval is 10 but there is no validation data: set data.valid_fraction > 0 (hold out the end of "
     "the training data) or evaluation.data (paths read like data.paths)"),
    (["evaluation.interval=10", "evaluation.data=[missing/valid.txt]", "data.dataset=text",
      "data.paths=[TRAIN]"], "'evaluation.data[0]' names missing/valid.txt, which does not exist"),
])
def test_bad_evaluation_settings_are_one_line(overrides, message, capsys, tmp_path):
    from loongforge.cli import main

    (tmp_path / "train.txt").write_text(TRAIN_TEXT)
    overrides = [o.replace("TRAIN", str(tmp_path / "train.txt")) for o in overrides]
    config = ROOT / "configs/quickstart.yaml"
    assert main(["check", str(config), f"run.output_dir={tmp_path / 'out'}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    # a value the command line gave is blamed on it; the file is named for what the file holds
    given = [o for o in overrides if o.startswith("evaluation.data=")]
    where = f"command line ({given[0]})" if given else config
    assert err == f"error: {where}: {message}"


def test_a_validation_split_smaller_than_a_global_batch_is_one_line(capsys, tmp_path):
    from loongforge.cli import main

    (tmp_path / "train.txt").write_text(TRAIN_TEXT)
    (tmp_path / "valid.txt").write_text("Too short to fill more than a few windows of thirty-two bytes.")
    config = ROOT / "configs/quickstart.yaml"
    args = [f"run.output_dir={tmp_path / 'out'}", "data.dataset=text", f"data.paths=[{tmp_path / 'train.txt'}]",
            f"evaluation.data=[{tmp_path / 'valid.txt'}]", "data.seq_length=16", "evaluation.interval=5",
            "training.micro_batch_size=8"]
    assert main(["check", str(config), *args]) == 2
    err = capsys.readouterr().err.strip()
    # 62 bytes of text (and an end-of-document token) hold 3 windows of 16 inputs + 1 label: 3 samples
    assert err == (f"error: {config}: evaluation: evaluation.data ({tmp_path / 'valid.txt'}) holds 3 sample(s), "
                   "fewer than one global batch of 8 (training.global_batch_size, or micro_batch_size x "
                   "data-parallel ranks); hold out more data or name more in evaluation.data")
    assert main(["check", str(config), *args, "training.micro_batch_size=3"]) == 0
    assert "evaluation: every 5 steps on 1 global batch(es) of 3 from evaluation.data" in capsys.readouterr().out


class ExpertCounts:
    """Records what an expert-placement plugin reads after each step: the step's tokens per expert."""

    def __init__(self) -> None:
        self.seen: list[list[list[int]]] = []

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        self.seen.append(trainer.expert_tokens)


def test_moe_evaluation_leaves_expert_counts_and_aux_loss_alone(tmp_path, register_plugin):
    """The routers run during an evaluation too; what a step reports (tokens per expert, the aux loss) stays the
    step's own: every step's sequences are routed to top-2 of the experts in each layer, nothing more."""
    from loongforge.train.run import run_training

    counts = register_plugin(ExpertCounts(), "expert-counts")

    def run(name: str, interval: int) -> tuple[list[dict], list]:
        counts.seen = []
        config = load_config(None, [
            f"run.output_dir={tmp_path / name}", "model.name=mixtral-tiny", "model.overrides.num_layers=1",
            "model.overrides.hidden_size=64", "model.overrides.moe_ffn_hidden_size=96", "data.seq_length=32",
            "data.valid_fraction=0.002", f"evaluation.interval={interval}", "evaluation.steps=2", *COMMON,
            "training.steps=3", "logging.tensorboard=false"])
        run_training(config, device="cpu")
        return _rows(tmp_path / name), counts.seen

    off_rows, off_counts = run("off", 0)
    on_rows, on_counts = run("on", 1)
    assert all("val_loss" in row for row in on_rows)
    assert [r["moe_aux_loss"] for r in on_rows] == [r["moe_aux_loss"] for r in off_rows]
    assert on_counts == off_counts and [sum(layer) for layer in on_counts[0]] == [4 * 32 * 2]
    assert [r["loss"] for r in on_rows] == [r["loss"] for r in off_rows]
