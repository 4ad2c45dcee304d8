"""GPU smoke benchmark: the tiny and a ~1B Llama train a few bf16 steps on one NVIDIA GPU; tokens/s and MFU.

Run through ``benchmarks/gpu_smoke.sh`` (which checks the machine first) or directly::

    python benchmarks/gpu_smoke.py                       # every case; TE cases only where TE imports
    python benchmarks/gpu_smoke.py --steps 30 --peak-tflops 989

Cases: ``llama-tiny`` (4 layers, d256, seq 256) and ``llama3.2-1b`` (16 layers, d2048, 1.24B parameters,
seq 2048), each with megatron-core's local layers and, when ``transformer-engine`` is installed, with
Transformer Engine layers (and TE FP8 where the GPU and TE offer a recipe). Each case trains in a fresh
process on the shipped corpus (byte tokenizer; token ids fit any vocabulary), so nothing is downloaded.

Throughput is the trainer's own figure (tokens per second over all steps but the first). Model FLOPs
utilisation counts the matmul FLOPs the model needs per trained token -- 6 x (parameters used in matmuls,
output layer included, input embedding excluded) + 6 x layers x seq x (query width), the causal-attention
score and value products for forward and backward -- divided by the GPU's dense bf16 peak (looked up by
name below, or ``--peak-tflops``). Recompute is off, so no FLOPs are counted twice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by a substring of ``torch.cuda.get_device_name``.
PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("H20", 148.0),
    ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.4),
)

#: name -> (model, seq_length, micro_batch_size, device options, precision)
CASES = {
    "tiny-local-bf16": ("llama-tiny", 256, 16, {"layers": "local"}, "bf16"),
    "tiny-te-bf16": ("llama-tiny", 256, 16, {"layers": "te"}, "bf16"),
    # fp16 parameters with megatron's dynamic loss scaler (optimizer.loss_scale null); the final loss and the
    # skipped steps of the first overflows show that scaling works
    "tiny-local-fp16": ("llama-tiny", 256, 16, {"layers": "local"}, "fp16"),
    "1b-local-bf16": ("llama3.2-1b", 2048, 4, {"layers": "local"}, "bf16"),
    "1b-te-bf16": ("llama3.2-1b", 2048, 4, {"layers": "te"}, "bf16"),
    "1b-te-fp8": ("llama3.2-1b", 2048, 4, {"layers": "te"}, "fp8"),
}


def model_flops_per_token(flavor, seq_length: int) -> float:
    """Training matmul FLOPs per token (forward + backward = 3 x forward's 2 x multiply-adds)."""
    from loongforge.models.flavor import flavor_num_params

    matmul_params = flavor_num_params(flavor, include_embeddings=False) + flavor.vocab_size * flavor.hidden_size
    attention = flavor.num_layers * seq_length * flavor.num_attention_heads * flavor.kv_channels
    return 6.0 * matmul_params + 6.0 * attention


def run_case(name: str, steps: int) -> dict:
    """Train one case in this process and return its numbers (called in a fresh child process)."""
    import torch
    from loongforge.config import load_config
    from loongforge.resolve import resolve_model_flavor
    from loongforge.train.run import run_training

    model, seq, mbs, options, precision = CASES[name]
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            "device=cuda", f"model.name={model}", f"run.output_dir={out}", "run.seed=1",
            "data.dataset=shipped-corpus", "data.tokenizer=byte", f"data.seq_length={seq}",
            f"training.micro_batch_size={mbs}", f"training.steps={steps}", f"training.precision={precision}",
            "checkpoint.save_at_end=false", "logging.progress=false", "logging.tensorboard=false",
            "device_options={" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}",
        ]
        config = load_config(None, overrides)
        summary = run_training(config)
        flavor = resolve_model_flavor(config)
    return {
        "case": name, "tokens_per_s": summary["tokens_per_s"], "flops_per_token": model_flops_per_token(flavor, seq),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu": torch.cuda.get_device_name(),
        "final_loss": summary.get("final_loss"),
    }


def peak_tflops(gpu: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in gpu), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU")
    parser.add_argument("--run", choices=list(CASES), help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)
    if args.run:
        print("RESULT " + json.dumps(run_case(args.run, args.steps)))
        return 0

    import torch
    from loongforge_cuda.capability import installed

    rows = []
    for name in args.cases:
        if CASES[name][3].get("layers") == "te" and not installed("transformer_engine"):
            print(f"{name}: not run (transformer-engine is not installed: pip install 'loongforge-cuda[te]')")
            continue
        if CASES[name][4] == "fp8" and torch.cuda.get_device_capability() < (8, 9):
            print(f"{name}: not run (FP8 needs compute capability 8.9+)")
            continue
        print(f"{name}: training {args.steps} steps ...", flush=True)
        child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", name, "--steps",
                                str(args.steps)], capture_output=True, text=True)
        results = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not results:
            print(f"{name}: FAILED\n{child.stderr[-3000:]}")
            rows.append((name, None))
            continue
        rows.append((name, json.loads(results[0])))

    print(f"\n{'case':<18} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'final loss':>10}")
    for name, row in rows:
        if row is None:
            print(f"{name:<18} {'failed':>12}")
            continue
        achieved = row["tokens_per_s"] * row["flops_per_token"] / 1e12
        peak = peak_tflops(row["gpu"], args.peak_tflops)
        mfu = f"{achieved / peak:.1%}" if peak else "n/a"
        loss = f"{row['final_loss']:.3f}" if row.get("final_loss") is not None else "-"
        print(f"{name:<18} {row['tokens_per_s']:>12,.0f} {achieved:>9.1f} {mfu:>7} {row['peak_mem_gib']:>9.1f} "
              f"{loss:>10}")
    gpus = {row["gpu"] for _, row in rows if row}
    print(f"\nGPU: {', '.join(gpus) or '?'}; MFU against a dense bf16 peak of "
          f"{peak_tflops(next(iter(gpus), ''), args.peak_tflops) or 'unknown (pass --peak-tflops)'} TFLOP/s")
    return 1 if any(row is None for _, row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
