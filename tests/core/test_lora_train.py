"""LoRA SFT runs end to end: only adapters are trained, the loss falls, and a resumed run continues exactly."""

from __future__ import annotations

import json

from loongforge import hookimpl, load_config

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
        "optimizer.lr=0.01",
        "optimizer.weight_decay=0.0",
        "scheduler.warmup_steps=2",
        "scheduler.decay=constant",
        "logging.progress=false",
        "logging.tensorboard=false",
        *LORA,
    ]
    return load_config(None, [*base, *overrides])


class TrainedParams:
    """Records, at train start, which parameters megatron's DDP and optimizer hold."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        model = trainer.model[0]
        names = {id(p): n for n, p in model.named_parameters()}
        self.ddp = sorted(names[id(p)] for buffer in model.buffers for p in buffer.params)
        self.optimizer = sorted(
            names[id(p)] for group in trainer.optimizer.optimizer.param_groups for p in group["params"]
        )
        self.trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())


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
    losses = _losses(straight)
    first, last = losses[1], sum(losses[s] for s in (14, 15, 16)) / 3
    assert summary["steps"] == 16 and last < first - 0.2, (first, last)

    resumed = tmp_path / "resumed"
    run_training(_config(resumed, load, "training.steps=8"))  # saves step 8 at the end
    again = run_training(_config(resumed, load, "training.steps=16", "checkpoint.save_at_end=false"))
    assert again["steps_this_run"] == 8
    after = _losses(resumed)
    assert [after[s] for s in range(9, 17)] == [losses[s] for s in range(9, 17)]  # bit-exact continuation
