#!/usr/bin/env bash
# GPU figures in one run (benchmarks/gpu_smoke.py): on a machine with one NVIDIA GPU, a ~1B Llama trains bf16 through
# LoongForge (local vs Transformer Engine layers, eager vs compiled, the FP8 recipes the GPU supports) and through
# plain megatron-core's own GPT step on the same shape; tokens/s, MFU against the dense bf16 peak, memory; JSON out.
# Bounded by --budget-s (default 420 s), so it finishes within 8 minutes.
#
# Installs nothing from the network. Needs, already installed in the active Python: a CUDA build of torch,
# megatron-core, loongforge-core and loongforge-cuda (optionally loongforge-cuda[te]). Offline install from a
# folder of wheels:  pip install --no-index --find-links WHEELS torch megatron-core ./loongforge-core ./plugins/loongforge-cuda
#
#   benchmarks/gpu_smoke.sh [--out gpu_smoke.json] [--steps 20] [--cases lf-local-bf16 mcore-local-bf16] [--peak-tflops 989]
#   python benchmarks/gpu_smoke.py --dry-run      # without a GPU: the same machinery on the CPU with llama-tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_smoke: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to measure" >&2
    exit 2
fi
nvidia-smi -L
"$PYTHON" - <<'PY'
import sys
try:
    import torch, megatron.core, loongforge, loongforge_cuda  # noqa: F401
except ImportError as exc:
    sys.exit(f"gpu_smoke: {exc.name} is not installed in {sys.executable} (see the header of this script)")
if not torch.cuda.is_available():
    sys.exit(f"gpu_smoke: torch {torch.__version__} sees no CUDA device (a CPU build of torch?)")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), megatron-core {megatron.core.__version__}, "
      f"GPU {torch.cuda.get_device_name()}")
PY
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
exec "$PYTHON" benchmarks/gpu_smoke.py "$@"
