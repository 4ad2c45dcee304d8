"""LoRA SFT runs end to end under the default schedule (linear warmup, cosine decay): only the adapters are trained,
each step at the scheduled learning rate, the base stays bit-identical, the loss falls, a resumed run continues
exactly; ``model.lora.base_dtype: bf16`` halves the frozen base's bytes and still trains."""

from __future__ import annotations

import json
import math

import torch
from loongforge import hookimpl, load_config

LR, MIN_LR, WARMUP = 0.02, 3.0e-5, 10  # optimizer.lr; optimizer.min_lr and scheduler.warmup_steps: the defaults
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]


def _config(out, *overrides):
    base = [
        f"run.output_dir={out}",
        "model.name=llama-debug",
        "data.dataset=shipped-chat",
        "data.seq_length=256",
        "data.pack=true",
        "training.phase=sft",
        "training.micro_batch_size=4",
        "training.threads=1",
        f"optimizer.lr={LR}",
        "optimizer.weight_decay=0.0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *LORA,
    ]
    return load_config(None, [*base, *overrides])


def scheduled_lr(step: int, steps: int) -> float:
    """The learning rate step ``step`` (1-based) of ``steps`` must use: linear warmup from 0 over WARMUP steps,
    then cosine decay to MIN_LR at the last step -- the documented default, written out independently here."""
    done = step - 1
    if done < WARMUP:
        return LR * done / WARMUP
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (done - WARMUP) / (steps - WARMUP)))


class TrainedParams:
    """Records which parameters megatron's DDP and optimizer hold, the learning rate each optimizer group holding
    an adapter used at every step, and the weights before and after training."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        model = trainer.model[0]
        names = {id(p): n for n, p in model.named_parameters()}
        self.ddp = sorted(names[id(p)] for buffer in model.buffers for p in buffer.params)
        self.groups = trainer.optimizer.optimizer.param_groups
        self.optimizer = sorted(names[id(p)] for group in self.groups for p in group["params"])
        self.trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())
        self.params = dict(model.named_parameters())
        self.start = {n: p.detach().clone() for n, p in self.params.items()}
        self.b_after, self.logged_lr = {}, {}
        self.used_lr = {1: self._adapter_lrs()}  # what the groups hold when a step starts is what it uses

    def _adapter_lrs(self):
        return {group["lr"] for group in self.groups if any(p.requires_grad for p in group["params"])}

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        self.used_lr[step + 1] = self._adapter_lrs()
        self.logged_lr[step] = metrics["lr"]
        self.b_after[step] = max(p.abs().max().item() for n, p in self.params.items() if n.endswith(".weight_b"))


class BaseBytes:
    """Records, at each run's start, the bytes and dtypes of the frozen (base) and trainable (adapter) parameters."""

    def __init__(self):
        self.runs = []

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        params = list(trainer.model[0].parameters())
        self.runs.append({
            "frozen_bytes": sum(p.numel() * p.element_size() for p in params if not p.requires_grad),
            "frozen": {p.dtype for p in params if not p.requires_grad},
            "trainable": {p.dtype for p in params if p.requires_grad},
        })


def _losses(out):
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_lora_sft_trains_only_adapters_and_resumes_exactly(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    # LoRA adapts a trained model: first a short full fine-tune (no adapters) gives the base weights.
    base = tmp_path / "base"
    run_training(_config(base, "training.steps=16", "model.lora=null"))
    load = f"model.load={base / 'checkpoints'}"

    recorder = TrainedParams()
    register_plugin(recorder, "trained-params")
    straight = tmp_path / "straight"
    summary = run_training(_config(straight, load, "training.steps=16", "checkpoint.save_at_end=false"))
    assert recorder.trainable and all(".lora.weight_" in n for n in recorder.trainable)
    assert len(recorder.trainable) == 2 * 4 * 2  # layers x targets x (A, B)
    assert recorder.ddp == recorder.optimizer == recorder.trainable
    # Every step ran at the scheduled rate (one value per step, shared by every group holding an adapter) ...
    for step in range(1, 17):
        (used,) = recorder.used_lr[step]
        assert math.isclose(used, scheduled_lr(step, 16), rel_tol=1e-9, abs_tol=1e-12), (step, used)
        assert math.isclose(recorder.logged_lr[step], used, rel_tol=1e-9, abs_tol=1e-12), step
    # ... so the first step, at lr 0, leaves B exactly zero, and the adapters move from the second on.
    assert recorder.b_after[1] == 0.0 and recorder.b_after[2] > 0.0
    moved = {n for n, p in recorder.params.items() if not torch.equal(p.detach(), recorder.start[n])}
    assert moved == set(recorder.trainable)  # the base stayed bit-identical; every adapter tensor trained
    losses = _losses(straight)
    first, last = losses[1], sum(losses[s] for s in (14, 15, 16)) / 3
    assert summary["steps"] == 16 and last < first - 0.2, (first, last)

    resumed = tmp_path / "resumed"
    run_training(_config(resumed, load, "training.steps=8", "scheduler.decay_steps=16"))  # saves step 8
    again = run_training(_config(resumed, load, "training.steps=16", "checkpoint.save_at_end=false",
                                 "scheduler.decay_steps=16"))
    assert again["steps_this_run"] == 8
    after = _losses(resumed)
    assert [after[s] for s in range(9, 17)] == [losses[s] for s in range(9, 17)]  # bit-exact continuation


def test_bf16_base_halves_the_frozen_bytes_and_trains(tmp_path, register_plugin):
    """``model.lora.base_dtype: bf16`` in an fp32 run: the frozen base in bf16 (exactly half the bytes of the fp32
    run's base), the adapters fp32, and the loss falls."""
    from loongforge.train.run import run_training

    recorder = register_plugin(BaseBytes(), "base-bytes")
    run_training(_config(tmp_path / "fp32", "training.steps=1", "checkpoint.save_at_end=false"))
    run_training(_config(tmp_path / "bf16", "training.steps=14", "checkpoint.save_at_end=false",
                         "model.lora.base_dtype=bf16"))
    fp32, bf16 = recorder.runs
    assert fp32["frozen"] == {torch.float32} and bf16["frozen"] == {torch.bfloat16}
    assert fp32["trainable"] == bf16["trainable"] == {torch.float32}
    assert 2 * bf16["frozen_bytes"] == fp32["frozen_bytes"]
    losses = _losses(tmp_path / "bf16")
    assert losses[14] < losses[1] - 0.2, losses
