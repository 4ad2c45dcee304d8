"""Speed metrics: model FLOPs per step counted from the model that was built, TFLOP/s per device and MFU against
the backend's dense peak, in metrics.jsonl, the summary and the progress line; the CPU peak probe's arithmetic and
its cache; the CUDA plugin's datasheet peaks by GPU and precision."""

from __future__ import annotations

import json

import pytest
import torch
from loongforge import hookimpl, load_config
from loongforge.train.throughput import StepSpeed

SHAPE = ["model.name=llama-tiny", "model.overrides.num_layers=2", "data.seq_length=32", "training.steps=3",
         "training.micro_batch_size=2", "training.threads=1", "logging.progress=false", "logging.interval=1",
         "checkpoint.save_at_end=false", "training.sample_tokens=0", "data.dataset=shipped-corpus"]


class Capture:
    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.trainer = trainer


def _independent_flops_per_token(model, seq: int) -> float:
    """6 x every matmul weight of the built model (the output layer too, the input embedding -- a lookup -- not)
    + 6 x layers x seq x query width (causal QK^T and AV, forward and backward), counted from the modules."""
    matmul = 0
    layers = 0
    for name, param in model.named_parameters():
        if param.dim() == 2 and "word_embeddings" not in name:
            matmul += param.numel()
        if name.endswith("self_attention.linear_proj.weight"):
            layers += 1
            query_width = param.shape[1]
    return 6 * matmul + 6 * layers * seq * query_width


def test_a_run_reports_model_tflops_and_mfu_from_its_own_flop_count(tmp_path, register_plugin, capsys):
    from loongforge.train.run import run_training

    capture = register_plugin(Capture(), "capture")
    summary = run_training(load_config(None, [f"run.output_dir={tmp_path}", *SHAPE]), device="cpu")
    trainer = capture.trainer
    engine = trainer.engine
    per_token = _independent_flops_per_token(engine.model[0], 32)
    assert engine.flops_per_step == pytest.approx(2 * 32 * per_token, rel=1e-12)

    peak = trainer.backend.dense_peak_flops("fp32")  # measured once per process: the figure the run divided by
    assert peak > 0 and trainer.backend.dense_peak_flops("fp32") == peak
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        achieved = engine.flops_per_step / row["step_time"]
        assert row["tflops"] == pytest.approx(achieved / 1e12, rel=1e-9)
        assert row["mfu"] == pytest.approx(achieved / peak, rel=1e-9)
        assert row["tokens_per_s"] == pytest.approx(64 / row["step_time"], rel=1e-9)
    timed = sum(row["step_time"] for row in rows[1:])  # the summary leaves out the first step, as for tokens/s
    assert summary["tflops"] == pytest.approx(2 * engine.flops_per_step / timed / 1e12, rel=1e-9)
    assert summary["mfu"] == pytest.approx(summary["tflops"] * 1e12 / peak, rel=1e-9)
    out = capsys.readouterr().out
    assert f"MFU {rows[-1]['mfu']:.1%}" in out  # the last step's plain progress line
    assert f"{summary['tflops']:.3g} TFLOP/s per device (MFU {summary['mfu']:.1%})" in out  # the closing line


def test_step_speed_divides_by_devices_and_peak():
    speed = StepSpeed(samples_per_step=8, tokens_per_step=8 * 256, flops_per_step=3e12, devices=2, peak_flops=6e12)
    assert speed.metrics(2, 4.0) == {"samples_per_s": 4.0, "tokens_per_s": 1024.0, "tflops": 0.75, "mfu": 0.125}
    assert StepSpeed(8, 2048, 3e12, devices=2).metrics(1, 0.5) == {"samples_per_s": 16.0, "tokens_per_s": 4096.0,
                                                                   "tflops": 3.0}  # no peak: no mfu
    assert StepSpeed(4).metrics(1, 2.0) == {"samples_per_s": 2.0}  # a task model: samples only
    assert StepSpeed(8, 2048, 3e12, peak_flops=1e12).metrics(0, 0.0) == {"samples_per_s": 0.0, "tokens_per_s": 0.0,
                                                                          "tflops": 0.0, "mfu": 0.0}


def test_the_matmul_probe_is_the_best_rate_of_its_products(monkeypatch):
    from loongforge.devices import matmul_peak

    # three timed products per library (torch's mm, then oneDNN's): 4, 3, 8 ms and 5, 2, 6 ms
    ticks = iter([0.0, 0.004, 1.0, 1.003, 2.0, 2.008, 3.0, 3.005, 4.0, 4.002, 5.0, 5.006])
    monkeypatch.setattr(matmul_peak.time, "perf_counter", lambda: next(ticks))
    before = torch.get_num_threads()
    best = matmul_peak.measured_matmul_peak(torch.float32, threads=1, size=64, repeats=3)
    assert best == pytest.approx(2 * 64**3 / 0.002)
    assert torch.get_num_threads() == before  # the thread count is put back


def test_cpu_peak_is_measured_in_the_training_dtype_once():
    from loongforge.devices import cpu

    backend = cpu.CPUBackend()
    cpu._measured_peak.cache_clear()
    assert backend.dense_peak_flops("fp32") > 0
    assert backend.dense_peak_flops("bf16") > 0
    assert cpu._measured_peak.cache_info().misses == 2
    backend.dense_peak_flops("fp32")
    assert cpu._measured_peak.cache_info().hits == 1
    assert backend.dense_peak_flops("fp16") is None  # the CPU backend does not train in fp16
