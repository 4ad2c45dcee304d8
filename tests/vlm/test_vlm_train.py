"""Composed VLMs train through ``loongforge train`` (core's megatron trainer) from the shipped config.

- swapping the LLM backbone (``model.foundation``) is the only change needed to train another family;
- training phases: alignment (``model.freeze`` of encoder and LLM: only the projector learns) and LoRA on the
  LLM (only adapters learn, the vision parts stay frozen);
- a bad vision-token setup fails in one line before training; the shipped checkpoint resumes bit-exactly;
- heterogeneous parallelism: the encoder replicated (tp=1) in front of a decoder at tp=2 (2 gloo processes)
  reproduces the one-process loss within 1e-5 relative.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
         "scheduler.warmup_steps=2", "checkpoint.save_at_end=false"]


def _config(out: Path, *overrides: str):
    return load_config(CONFIG, [f"run.output_dir={out}", *QUIET, *overrides])


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


class Trainable:
    """Records which parameters train and a copy of every parameter at train start and end."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        model = trainer.model[0]
        self.trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        self.after = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}

    def changed(self) -> set[str]:
        return {n for n, p in self.after.items() if not p.equal(self.before[n])}


class ModuleKinds:
    """The class names of the language model's modules, as trained."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.kinds = {type(m).__name__ for m in trainer.model[0].module.language_model.modules()}


#: Foundations with a module only their own layers have: the family's layers must be what the VLM trains, not
#: core's grouped-query layer built from the family's sizes (checked in the sweep below).
OWN_MODULES = {"deepseek-v3-tiny": "DeepSeekMLA", "deepseek-v32-tiny": "DeepSeekMLA",
               "qwen3-next-tiny": "GatedDeltaNet"}


def test_swapping_the_llm_is_one_line_and_it_learns(tmp_path):
    """12 steps with another family's LLM: the loss falls by over a nat (the sweep below runs every family 5 steps)."""
    from loongforge.train.run import run_training

    summary = run_training(_config(tmp_path / "run", "model.foundation=llama3-tiny", "training.steps=12"))
    losses = _losses(tmp_path / "run")
    assert summary["steps"] == 12 and sum(losses[s] for s in (10, 11, 12)) / 3 < losses[1] - 1.0, losses


def _core_llm_flavors() -> list[str]:
    """Every tiny decoder flavor core registers (read from the registry, so a new core family joins the sweep)."""
    from loongforge.models.flavor import DecoderFlavor
    from loongforge.plugins import get_host

    registry = get_host().registry("model")
    return sorted(entry.name for entry in registry.entries() if entry.name.endswith("-tiny")
                  and entry.provider == "loongforge-core" and isinstance(entry.load(), DecoderFlavor))


@pytest.mark.parametrize("foundation", _core_llm_flavors())
def test_every_core_llm_family_is_a_foundation_by_one_line(tmp_path, register_plugin, capsys, foundation):
    """5 steps of the shipped VLM recipe with each core family as its LLM: positions, norms and layers of every kind
    (learned absolute positions included) reach the decoder through the composition."""
    from loongforge.cli import main
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    flavor = get_host().registry("model").load(foundation, where="test")
    swap = [f"model.foundation={foundation}"]
    if flavor.masked_attention_blocker is not None:  # causal-only attention: check refuses packed rows up front
        assert main(["check", str(CONFIG), *QUIET, *swap]) != 0
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "data.pack needs block-diagonal attention masks" in said[0], said
        swap.append("data.pack=false")
    recorder = register_plugin(Trainable(), "trainable")
    kinds = register_plugin(ModuleKinds(), "module-kinds")
    summary = run_training(_config(tmp_path / "run", *swap, "training.steps=5"))
    losses = _losses(tmp_path / "run")
    assert summary["steps"] == 5 and losses[5] < losses[1], losses
    if foundation in OWN_MODULES:
        assert OWN_MODULES[foundation] in kinds.kinds, sorted(kinds.kinds)
    if getattr(flavor, "mtp_num_layers", 0):  # the multi-token-prediction block trains on the answers too
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert "MultiTokenPredictionBlock" in kinds.kinds and all(row["mtp_loss"] > 0 for row in rows)
    learned = [n for n in recorder.trainable if "position_embeddings" in n]
    assert bool(learned) == (flavor.position_embedding == "learned_absolute")
    assert set(learned) <= recorder.changed()  # the learned positions are used, hence trained


def test_alignment_phase_trains_only_the_projector(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    recorder = register_plugin(Trainable(), "trainable")
    run_training(_config(tmp_path / "run", "model.freeze=[encoder.*,language_model.*]", "training.steps=3"))
    assert recorder.trainable and all(n.startswith("module.projector.") for n in recorder.trainable)
    assert recorder.changed() == set(recorder.trainable)  # every projector weight moved, nothing else did


def test_lora_phase_adapts_only_the_llm(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    recorder = register_plugin(Trainable(), "trainable")
    run_training(_config(tmp_path / "run", "model.lora.rank=4", "training.steps=3"))
    assert recorder.trainable and all(".lora." in n and ".language_model." in n for n in recorder.trainable)
    assert recorder.changed() <= set(recorder.trainable)


def test_mismatched_vision_tokens_fail_in_one_line(tmp_path):
    from loongforge.errors import LoongForgeError
    from loongforge.train.run import run_training

    # found when the data is opened, in pre-flight: the line names the config it comes from
    with pytest.raises(LoongForgeError, match=r"^\S*configs/vlm-shapes\.yaml: tokenizer 'byte-vision' writes vision "
                                              r"token ids that the model does not use: image pad 259 \(model: 380\)"):
        run_training(_config(tmp_path / "run", "model.name=qwen2-vl-tiny", "model.encoder=null",
                             "model.projector=null", "model.foundation=null", "training.steps=1"))


def test_qwen3_vl_tiny_trains_on_the_shapes_recipe(tmp_path, register_plugin):
    """qwen3-vl-tiny (its vision token ids set to the byte-vision tokenizer's) in the shipped recipe: the loss falls
    and the DeepStack mergers and learned position grid, which only reach the loss through DeepStack and the
    encoder, learn (parity with transformers: test_qwen3_vl.py)."""
    from loongforge.train.run import run_training

    recorder = register_plugin(Trainable(), "trainable")
    tokens = [f"model.overrides.{key}={value}" for key, value in (("image_token_id", 259), ("video_token_id", 262),
                                                                  ("vision_start_token_id", 260),
                                                                  ("vision_end_token_id", 261))]
    run_training(_config(tmp_path / "run", "model.name=qwen3-vl-tiny", "model.encoder=null", "model.projector=null",
                         "model.foundation=null", "training.steps=3", *tokens))
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values()), losses
    assert losses[3] < losses[1], losses
    assert {"module.encoder.deepstack_mergers.1.fc2.weight", "module.encoder.pos_embed.weight"} <= recorder.changed()


@pytest.mark.slow
@pytest.mark.distributed
def test_encoder_tp1_decoder_tp2_matches_one_process(tmp_path):
    def train(out: Path, *extra: str) -> dict[int, float]:
        cmd = [sys.executable, "-m", "loongforge.cli", "train", str(CONFIG), f"run.output_dir={out}", *QUIET,
               "training.steps=4", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return _losses(out)

    single = train(tmp_path / "single")
    split = train(tmp_path / "tp2", "parallel.tp=2", "--nproc", "2")
    assert single[4] < single[1]
    worst = max(abs(split[s] - single[s]) / single[s] for s in single)
    assert worst <= 1e-5, (single, split)


def test_evaluate_answers_held_out_questions_and_scores_against_chance(tmp_path):
    from loongforge.train.run import run_training
    from loongforge_vlm.evaluate import evaluate, score

    run_training(_config(tmp_path / "run", "training.steps=2", "checkpoint.save_at_end=true"))
    result = evaluate(tmp_path / "run" / "checkpoints", limit=6)
    assert result["overall"]["n"] == 6 and 0.25 <= result["overall"]["chance"] <= 1 / 3
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-0000002" / "eval.json").read_text())["overall"] \
        == result["overall"]
    scored = score(["red", "blue", "circle", "3"], ["red", "green", "circle", "2"])
    assert scored["colour"] == {"n": 2, "accuracy": 0.5, "chance": 0.25}
    assert scored["shape"]["accuracy"] == 1.0 and scored["count"]["accuracy"] == 0.0
    assert scored["overall"]["accuracy"] == 0.5


def test_eval_and_convert_read_a_lora_run_with_its_adapters_folded_in(tmp_path, monkeypatch):
    """``loongforge eval`` (and ``convert``) of a VLM LoRA run read the weights the run trained: base + adapters,
    folded in by core's one loader (``load_trained_weights``), not the frozen base alone (read silently before)."""
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop import mcore_checkpoint
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.train.run import run_training
    from loongforge_vlm.evaluate import evaluate

    run_training(_config(tmp_path / "run", "model.lora.rank=4", "training.steps=3", "checkpoint.save_at_end=true"))
    path = find_checkpoint(tmp_path / "run" / "checkpoints")
    config = mcore_checkpoint.checkpoint_config(path)
    flavor = mcore_checkpoint.resolve_family(config)
    with standalone_world() as backend:
        merged = build_standalone(flavor, backend, "fp32")
        mcore_checkpoint.load_trained_weights(path, [merged], config)
        base = build_standalone(flavor, backend, "fp32")
        mcore_checkpoint.load_model_weights(path, [base])
    merged_state = {n: t for n, t in merged.state_dict().items() if t is not None}  # not megatron's _extra_state
    base_state = {n: t for n, t in base.state_dict().items() if t is not None}
    adapted = {n for n in base_state if n.endswith(("linear_qkv.weight", "linear_proj.weight"))}
    assert adapted and not any(".lora." in n for n in merged_state)  # folded: a plain model's keys
    assert all(not merged_state[n].equal(base_state[n]) for n in adapted)  # the trained adapters are in
    assert all(merged_state[n].equal(base_state[n]) for n in base_state if n not in adapted)

    calls = []
    loader = mcore_checkpoint.load_trained_weights
    monkeypatch.setattr(mcore_checkpoint, "load_trained_weights",
                        lambda p, chunks, c: calls.append(c.model.lora) or loader(p, chunks, c))
    evaluate(path, limit=2)
    assert [lora.rank for lora in calls] == [4]
