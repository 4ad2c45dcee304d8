"""Predicted vs measured peak memory of tiny vision-language models on CPU (the planner's ``vision`` part).

Same method as ``benchmarks/planner_calibration.py``: each layout trains for two steps through the real trainer
(``loongforge.train.measure``, torchrun + gloo for 2 processes), which records every rank's peak live tensor
bytes from the profiler's allocator events; the prediction is ``loongforge.planner.memory.estimate_memory`` of
the decoder plus the VLM's vision part with the default coefficients. Data: ``configs/vlm-shapes.yaml``'s
synthetic shapes, unpacked (one image per sample), seq 128, 4 samples per micro-batch, fp32.

    python benchmarks/planner_vlm_memory.py            # 7 layouts, ~4 minutes on 2 cores

Baseline for the ratios: the memory model's prediction (error = predicted / measured - 1; 0 is exact).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loongforge.config import load_config
from loongforge.planner.auto import workload_for
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import estimate_memory
from loongforge.resolve import resolve_model_flavor

#: The byte-vision tokenizer's ids (the Qwen tiny flavors carry Qwen's, so the run overrides them).
BYTE_VISION_IDS = "image_token_id: 259, vision_start_token_id: 260, vision_end_token_id: 261, video_token_id: 262"
CONFIG = """
run: {seed: 1}
model: MODEL
data: {dataset: vlm-shapes, tokenizer: byte-vision, seq_length: 128, pack: false}
training: {phase: sft, micro_batch_size: 4, global_batch_size: 8, threads: 1}
logging: {interval: 1}
"""
# (model, vision tokens per sample, processes, extra overrides). Qwen's processor upscales the 32 px images to
# 56 px (min_pixels 56*56): 14 x 14 patches of 4 px = 49 tokens; SigLIP-tiny: 8 x 8 patches merged 2 x 2 = 16.
CASES = [
    ("vlm-tiny", 16, 1, []),
    ("vlm-tiny", 16, 2, []),
    ("vlm-tiny", 16, 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("qwen2-vl-tiny", 49, 1, []),
    ("qwen2-vl-tiny", 49, 2, []),
    ("qwen2-vl-tiny", 49, 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("qwen2-vl-tiny", 49, 1, ["model.overrides.encoder_recompute=true"]),
]


def measure(config: Path, out: Path, nproc: int, overrides: list[str]) -> int:
    """The highest peak over the ranks of one measured run."""
    module = ["-m", "loongforge.train.measure", str(config), str(out), "--time-steps=2", *overrides]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    done = subprocess.run([sys.executable, *launcher, *module], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{config} {overrides}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return max(json.loads(p.read_text())["peak_bytes"] for p in out.glob("rank*.json"))


def predict(config: Path, nproc: int, overrides: list[str]) -> float:
    resolved = load_config(str(config), overrides)
    par = resolved.parallel
    dp = nproc // (par.tp * par.pp)
    mbs = resolved.training.micro_batch_size
    cand = Candidate(tp=par.tp, pp=par.pp, dp=dp, etp=par.tp, sequence_parallel=par.sequence_parallel,
                     distributed_optimizer=par.distributed_optimizer, micro_batch_size=mbs,
                     num_microbatches=resolved.training.global_batch_size // (mbs * dp))
    return estimate_memory(workload_for(resolved, resolve_model_flavor(resolved), "local"), cand).total


def main() -> None:
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, (model, tokens, nproc, overrides) in enumerate(CASES):
            ids = f", {BYTE_VISION_IDS}" if model.startswith("qwen") else ""
            spec = f"{{name: {model}, overrides: {{vision_tokens_per_sample: {tokens}{ids}}}}}"
            config = root / f"case{i}.yaml"
            config.write_text(CONFIG.replace("MODEL", spec))
            measured = measure(config, root / f"case{i}", nproc, overrides)
            predicted = predict(config, nproc, overrides)
            errors.append(predicted / measured - 1)
            print(f"{model:14s} n={nproc} {' '.join(overrides) or '-':58s} predicted {predicted / 2**20:6.2f} MiB "
                  f"measured {measured / 2**20:6.2f} MiB  error {errors[-1]:+.1%}", flush=True)
    within = sum(abs(e) <= 0.15 for e in errors)
    print(f"{within}/{len(errors)} layouts within 15%, max |error| {max(abs(e) for e in errors):.1%}")


if __name__ == "__main__":
    main()
