"""Per-part optimisation of a composed VLM through ``loongforge train`` (the megatron engine's real path).

- each part's optimizer group carries its configured peak/final learning rate and weight decay (biases and norms
  still without decay), and the metrics log each part's rate;
- a frozen part (``freeze``) has no gradients and no optimizer state and stays bitwise unchanged; a part at
  ``lr: 0`` stays bitwise unchanged too while its Adam moments fill, and the other parts change;
- the staged recipe (configs/vlm-staged.yaml): the projector changes from step 1, the encoder and the LLM only from
  the step after ``unfreeze_at_step``; a run resumed from a checkpoint before the boundary ends bitwise where the
  uninterrupted run ends;
- bad values fail in one line naming the key (``loongforge check``), and so does a misspelt part.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "configs" / "vlm-shapes.yaml"
STAGED = ROOT / "configs" / "vlm-staged.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
         "training.micro_batch_size=2", "checkpoint.save_at_end=false", "logging.interval=1",
         "scheduler.warmup_steps=0", "checkpoint.resume=never"]
PARTS = {"encoder.": "encoder", "projector.": "projector", "language_model.": "foundation"}


def _part(name: str) -> str:
    return next(part for prefix, part in PARTS.items() if name.removeprefix("module.").startswith(prefix))


class Recorder:
    """The optimizer's groups at train start (by parameter name), and every weight after each step."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        chunk = trainer.model[0]
        names = {id(p): n for n, p in chunk.named_parameters()}
        self.groups = [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
                       for g in trainer.optimizer.param_groups]
        self.trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
        self.weights = [self._weights(trainer)]

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        self.weights.append(self._weights(trainer))

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        names = {id(p): n for n, p in trainer.model[0].named_parameters()}
        self.moments = {names[id(p)]: s for p, s in trainer.optimizer.optimizer.state.items()}

    @staticmethod
    def _weights(trainer):
        return {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}

    def changed(self, before: int, after: int) -> set[str]:
        """The parts with a weight that differs between the records ``before`` and ``after`` (0: the start)."""
        old, new = self.weights[before], self.weights[after]
        return {_part(n) for n in new if not new[n].equal(old[n])}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_each_part_trains_with_its_own_settings(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    recorder = register_plugin(Recorder(), "recorder")
    run_training(load_config(SHAPES, [
        f"run.output_dir={tmp_path}", *QUIET, "training.steps=3", "optimizer.weight_decay=0.01",
        "model.encoder={name: siglip-tiny, lr: 0}",
        "model.projector={lr: 3.0e-3, min_lr: 1.0e-3, weight_decay: 0.05}",
        "model.foundation={name: qwen3-tiny, freeze: true}"]), device="cpu")

    by_part: dict[str, list[dict]] = {}
    for settings, names in recorder.groups:
        for part in {_part(n) for n in names}:
            by_part.setdefault(part, []).append(settings)
        assert len({_part(n) for n in names}) <= 1, "a group mixes parts"
        if names:  # megatron keeps an empty group per override set it saw on any rank
            assert settings.get("group_name") in {_part(n) for n in names}
    assert set(by_part) == {"encoder", "projector"}  # the frozen foundation is in no group
    assert {(g["max_lr"], g["min_lr"]) for g in by_part["projector"]} == {(3e-3, 1e-3)}
    assert {round(g["weight_decay"], 12) for g in by_part["projector"]} == {0.05, 0.0}  # weights / biases, norms
    # lr 0: the run's decay ratio keeps the floor at 0; the run's weight decay applies (scaled by lr 0)
    assert {(g["max_lr"], g["min_lr"]) for g in by_part["encoder"]} == {(0.0, 0.0)}
    assert {round(g["weight_decay"], 12) for g in by_part["encoder"]} == {0.01, 0.0}

    assert not any(_part(n) == "foundation" for n in recorder.trainable)
    assert recorder.changed(0, 3) == {"projector"}  # the encoder at lr 0 and the frozen LLM bitwise unchanged
    assert {_part(n) for n in recorder.moments} == {"encoder", "projector"}  # the frozen LLM holds no state
    encoder = [s["exp_avg"] for n, s in recorder.moments.items() if _part(n) == "encoder"]
    assert max(m.abs().max().item() for m in encoder) > 0  # at lr 0 its gradients still flow into Adam's moments

    rows = _rows(tmp_path)
    assert [r["lr/projector"] for r in rows][0] == 3e-3 and all(r["lr/encoder"] == 0.0 for r in rows)
    assert rows[0]["lr"] == 2e-3 and "lr/foundation" not in rows[0]
    # cosine over 3 steps from 3e-3 to 1e-3 (the run's own curve, 2e-3 -> 2e-4, in the same shape)
    expected = [1e-3 + 0.5 * (1 + math.cos(math.pi * s / 3)) * 2e-3 for s in range(3)]
    assert [r["lr/projector"] for r in rows] == pytest.approx(expected, rel=1e-12)


def _staged(out: Path, steps: int, *more: str):
    return load_config(STAGED, [f"run.output_dir={out}", *QUIET[:-1], f"training.steps={steps}",
                                "scheduler.decay_steps=4", "model.encoder.unfreeze_at_step=2",
                                "model.foundation.unfreeze_at_step=2", *more])


def test_staged_recipe_aligns_the_projector_first_and_resumes_bit_exactly(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    straight = register_plugin(Recorder(), "straight")
    run_training(_staged(tmp_path / "straight", 4, "checkpoint.resume=never"), device="cpu")
    for step in (1, 2):  # steps 1..unfreeze_at_step: the projector alone moves
        assert straight.changed(step - 1, step) == {"projector"}, step
    assert straight.changed(2, 3) == {"encoder", "projector", "foundation"}
    rows = _rows(tmp_path / "straight")
    assert [r["lr/encoder"] > 0 for r in rows] == [False, False, True, True]

    # interrupted before the boundary (a checkpoint at step 1), then resumed past it
    out = tmp_path / "resumed"
    run_training(_staged(out, 1, "checkpoint.save_at_end=true"), device="cpu")
    resumed = register_plugin(Recorder(), "resumed")
    run_training(_staged(out, 4), device="cpu")
    final, expected = resumed.weights[-1], straight.weights[-1]
    assert all(final[n].equal(expected[n]) for n in expected)
    assert [r["loss"] for r in _rows(out) if r["step"] > 1] == [r["loss"] for r in rows if r["step"] > 1]


@pytest.mark.parametrize(("override", "message"), [
    ("model.encoder={name: siglip-tiny, lr: -1.0e-3}", "'model.encoder.lr' must be a finite number >= 0, got -0.001"),
    ("model.projector={weight_decay: -1}", "'model.projector.weight_decay' must be a finite number >= 0"),
    ("model.encoder={name: siglip-tiny, freeze: true, unfreeze_at_step: 3}",
     "model.encoder: freeze and unfreeze_at_step exclude each other"),
    ("model.projector={lr: 1.0e-3, min_lr: 1.0e-2}", "model.projector: min_lr (0.01) is above its lr (0.001)"),
    ("model.foundation={name: qwen3-tiny, recompute: true}", "model.foundation.recompute: only the encoder"),
    ("model.projector={merge: 3}", "model.projector.merge=3 does not divide the encoder's 8x8 patch grid"),
    ("model.encoder={name: siglip-tiny, anyres_pinpoints: [[32, 48]]}",
     "siglip flavor: anyres_pinpoints [[32, 48]] are not positive multiples of image_size 32"),
    ("model.projecter={lr: 1.0e-3}", "model 'vlm' has no part 'projecter'; its parts: encoder, projector, foundation. "
                                      "Did you mean 'projector'?"),
])
def test_check_refuses_bad_part_options_in_one_line(tmp_path, capsys, override, message):
    from loongforge.cli import main

    assert main(["check", str(SHAPES), override, f"run.output_dir={tmp_path}"]) != 0
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors


def test_resume_refuses_changed_part_settings():
    from loongforge.errors import ConfigError
    from loongforge.resolve import resolve_model_flavor
    from loongforge.train.resume_settings import check_resume_settings, schedule_settings

    def settings(*overrides: str):
        config = load_config(STAGED, list(overrides))
        return config, resolve_model_flavor(config).parameter_groups()

    config, groups = settings()
    saved = schedule_settings(config, 4, groups)
    assert not check_resume_settings(saved, config, 4, "ckpt", groups)
    for overrides, change in ((["model.encoder.lr=1.0e-3"], "model.encoder.lr 0.0005 -> 0.001"),
                              (["model.foundation={name: qwen3-tiny, lr: 1.0e-3}"],
                               "model.foundation.unfreeze_at_step 100 -> (unset)")):
        changed, changed_groups = settings(*overrides)
        with pytest.raises(ConfigError, match=re.escape(f"different optimizer/schedule settings: {change};")):
            check_resume_settings(saved, changed, 4, "ckpt", changed_groups)
