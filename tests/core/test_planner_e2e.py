"""End to end on CPU: the memory model against a measured run, and ``parallel: auto`` through the trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from loongforge.models.registration import all_flavors
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import Workload, estimate_memory

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_measured_peak_matches_prediction(tmp_path):
    """One process, llama-tiny, 2 micro-batches of 4 x 256 tokens: profiler-measured peak live bytes within 15%."""
    config = tmp_path / "tiny.yaml"
    config.write_text("run: {seed: 1}\nmodel: llama-tiny\ndata: {seq_length: 256}\n"
                      "training: {micro_batch_size: 4, global_batch_size: 8, threads: 1}\n")
    done = subprocess.run([sys.executable, "-m", "loongforge.train.measure", str(config), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads((tmp_path / "out" / "rank0.json").read_text())
    workload = Workload(all_flavors()["llama-tiny"], 256, "fp32", kernels="local")
    predicted = estimate_memory(workload, Candidate(tp=1, pp=1, dp=1, micro_batch_size=4, num_microbatches=2)).total
    assert abs(predicted - measured["peak_bytes"]) / measured["peak_bytes"] < 0.15
    assert measured["step_time"] > 0


def test_parallel_auto_trains_and_records_its_decision(tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text(f"run: {{output_dir: {tmp_path / 'run'}, seed: 1}}\nmodel: llama-debug\nparallel: auto\n"
                      "data: {seq_length: 64}\ntraining: {steps: 1, micro_batch_size: 2, threads: 1}\n"
                      "logging: {progress: false, tensorboard: false}\n")
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config),
                           "parallel.planner.device_memory=2GiB"], capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "parallel: auto chose tp1 pp1 dp1 mbs2x1" in done.stdout
    metadata = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/metadata.json")).read_text())
    decision = metadata["parallel_auto"]
    assert decision["parallel"]["tp"] == 1 and decision["device_memory"] == 2 * 2**30
    assert decision["predicted_peak_bytes"] > 0 and decision["fitting"] >= 1
    assert metadata["parallel"]["tp"] == 1  # the layout the run used is the one recorded as chosen
