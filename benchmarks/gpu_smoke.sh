#!/usr/bin/env bash
# GPU smoke test: on a machine with one NVIDIA GPU, train the tiny and a ~1B Llama for a few bf16 steps with
# megatron-core's local layers and, where installed, Transformer Engine; print tokens/s and MFU.
#
# Installs nothing from the network. Needs, already installed in the active Python: a CUDA build of torch,
# megatron-core, loongforge-core and loongforge-cuda (optionally loongforge-cuda[te]). Offline install from a
# folder of wheels:  pip install --no-index --find-links WHEELS torch megatron-core ./loongforge-core ./plugins/loongforge-cuda
#
#   benchmarks/gpu_smoke.sh [--steps 20] [--cases tiny-local-bf16 1b-local-bf16] [--peak-tflops 989]
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
