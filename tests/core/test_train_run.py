"""End-to-end training in this process: lifecycle hooks, checkpoint fallback, and learning on the shipped corpus.

These runs share one pytest process on purpose: ``run_training`` must tear down megatron's parallel state
and the process group it created, so that a second run (a resume, a notebook re-run) starts cleanly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from loongforge import hookimpl, load_config
from loongforge.optimizations import Optimization


def _config(tmp_path, *overrides):
    base = [
        f"run.output_dir={tmp_path / 'out'}",
        "model.name=llama-debug",
        "data.seq_length=64",
        "training.micro_batch_size=4",
        "training.threads=1",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    return load_config(None, [*base, *overrides])


class Recorder:
    """A plugin that records every lifecycle call and stores a little state in each checkpoint."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.calls.append(("start", trainer.step))

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time"} <= set(metrics)
        self.calls.append(("step", step))

    @hookimpl
    def loongforge_on_checkpoint_save(self, trainer, path, extra_state):
        assert ".tmp-step-" in path  # called before the checkpoint becomes visible
        extra_state["recorder"] = {"saved_at": trainer.step}
        self.calls.append(("save", trainer.step))

    @hookimpl
    def loongforge_on_checkpoint_load(self, trainer, path, extra_state):
        self.calls.append(("load", extra_state["recorder"]["saved_at"]))

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        self.calls.append(("end", metrics["steps"]))


def test_hooks_then_corrupt_checkpoint_falls_back(tmp_path, register_plugin, capfd):
    from loongforge.train.run import run_training

    recorder = register_plugin(Recorder(), "recorder")
    summary = run_training(_config(tmp_path, "training.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=3"))
    assert recorder.calls == [
        ("start", 0),
        ("step", 1),
        ("step", 2),
        ("save", 2),
        ("step", 3),
        ("step", 4),
        ("save", 4),
        ("end", 4),
    ]
    ckpts = tmp_path / "out" / "checkpoints"
    assert summary["checkpoint_dir"] == str(ckpts / "step-0000004")
    metadata = json.loads((ckpts / "step-0000004" / "metadata.json").read_text())
    assert metadata["device"] == "cpu" and "auto" in metadata["device_reason"]
    assert metadata["parallel"]["world_size"] == 1

    damaged = next((ckpts / "step-0000004" / "model_optim").glob("*.distcp"))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the checksum can tell
    damaged.write_bytes(bytes(data))
    recorder.calls.clear()
    capfd.readouterr()
    summary = run_training(_config(tmp_path, "training.steps=5", "checkpoint.interval=0", "checkpoint.keep_last=3"))
    err = capfd.readouterr().err
    assert f"checkpoint {ckpts / 'step-0000004'}: file model_optim/{damaged.name} does not match" in err
    assert "falling back" in err
    assert recorder.calls == [("load", 2), ("start", 2), ("step", 3), ("step", 4), ("step", 5), ("save", 5), ("end", 5)]
    assert summary["steps_this_run"] == 3


def test_explicit_resume_path_must_verify(tmp_path):
    from loongforge.checkpoint import CheckpointCorruptError
    from loongforge.train.run import run_training

    run_training(_config(tmp_path, "training.steps=1"))
    ckpt = tmp_path / "out" / "checkpoints" / "step-0000001"
    (ckpt / "trainer.json").write_text("{}")
    with pytest.raises(CheckpointCorruptError, match="trainer.json"):
        run_training(_config(tmp_path, "training.steps=2", f"checkpoint.resume={ckpt}"))


def test_loss_falls_on_shipped_corpus_and_samples_text(tmp_path):
    from loongforge.train.run import run_training

    summary = run_training(
        _config(
            tmp_path,
            "training.steps=30",
            "optimizer.lr=0.003",
            "scheduler.warmup_steps=3",
            "checkpoint.save_at_end=false",
            "training.sample_tokens=20",
            "training.sample_prompt=Elizabeth",
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert summary["sample"].startswith("Elizabeth") and len(summary["sample"]) > len("Elizabeth")
    assert summary["tokens_per_s"] > 0


def test_device_request_precedence(monkeypatch):
    from loongforge.train.run import requested_device

    config = load_config(None, ["device=cpu"])
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)
    assert requested_device(config, None, "--device") == ("cpu", "device in <defaults>")
    monkeypatch.setenv("LOONGFORGE_DEVICE", "xpu")
    assert requested_device(config, None, "--device") == ("xpu", "LOONGFORGE_DEVICE")
    assert requested_device(config, "cuda", "--device") == ("cuda", "--device")


def test_checkpoint_from_another_model_fails_in_one_line(tmp_path):
    from loongforge.errors import LoongForgeError
    from loongforge.train.run import run_training

    run_training(_config(tmp_path, "training.steps=1"))
    with pytest.raises(LoongForgeError, match=r"step-0000001 does not fit this run's model .* shape mismatch"):
        run_training(_config(tmp_path, "training.steps=2", "model.overrides.num_layers=3"))


@dataclass(frozen=True)
class StopAfterOptions:
    stop_at: int


class StopAfter(Optimization):
    """An optimization (enabled by name from ``optimizations:``) that ends training early."""

    name = "stop-after"
    options_type = StopAfterOptions

    def __init__(self, options):
        super().__init__(options)
        self.stop_at = self.options.stop_at

    @hookimpl
    def loongforge_on_step_end(self, trainer, step):
        trainer.should_stop = step >= self.stop_at


class Provider:
    @hookimpl
    def loongforge_register_optimizations(self, registry):
        registry.register("stop-after", StopAfter)

    @hookimpl
    def loongforge_configure(self, config):
        config.run.name = "configured-by-plugin"


def test_configure_hook_and_config_enabled_optimization(tmp_path, register_plugin, plugin_host):
    from loongforge.train.run import run_training

    register_plugin(Provider(), "provider")
    summary = run_training(_config(tmp_path, "training.steps=5", "optimizations.stop-after.stop_at=2"))
    assert summary["steps"] == 2
    saved = (tmp_path / "out" / "checkpoints" / "step-0000002" / "config.yaml").read_text()
    assert "configured-by-plugin" in saved and "stop-after" in saved
    assert "optimization:stop-after" not in plugin_host.plugins  # registered for that run only


def test_precision_the_device_cannot_do_is_one_line(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("model: llama-debug\ntraining: {precision: fp8}\n")
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), "--device", "cpu"],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "training.precision / device_options" in result.stderr and "fp8" in result.stderr
    assert "Traceback" not in result.stderr

    config.write_text("model: llama-debug\ndevice_options: {cuda_graphs: true}\n")
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), "--device", "cpu"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "takes no megatron options; got cuda_graphs" in result.stderr
