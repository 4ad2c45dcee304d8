#!/usr/bin/env bash
# GPU figures in one run (benchmarks/gpu_smoke.py): on a machine with one NVIDIA GPU, a ~1B Llama trains bf16 through
# LoongForge (local vs Transformer Engine layers, eager vs compiled, the FP8 recipes the GPU supports) and through
# plain megatron-core's own GPT step on the same shape; tokens/s, MFU against the dense bf16 peak, memory; the
# quickstart's fp32 losses on CUDA vs CPU (TF32 off, relative gap <= 1e-4); optionally the cuda plugin's tests
# first (--with-tests). JSON out. Bounded by --budget-s (default 420 s, tests and numerics included), so it
# finishes within 8 minutes.
#
# Installs nothing from the network. Needs a CUDA build of torch, megatron-core, loongforge-core and loongforge-cuda
# (optionally Transformer Engine and flash-attn): either installed in the active Python, or as wheels in a folder
# made by benchmarks/gpu_wheels.sh on a machine with network, installed here with --wheels DIR into a private
# target folder ($GPU_SMOKE_SITE, default /tmp/loongforge-gpu-site) that goes first on PYTHONPATH (no index, no
# dependencies: torch and the rest come from the machine). Before training it checks the GPU and every module and
# reports all that is missing at once; a missing Transformer Engine or flash-attn only lists their cases as not run.
#
# The lent H200 (as found on a loan): Python 3.12 (/opt/torch/.venv/bin/python3) with torch 2.11.0+cu130, triton,
# transformers, numpy, pluggy, pyyaml, safetensors, rich, tensorboard, psutil, pytest and pytest-timeout; NO
# megatron-core, loongforge, importlib-metadata, transformer-engine or flash-attn, and no network. Files reach it
# only inside the repository's working tree (64 MiB in all, ignored paths only when carried). Transformer Engine
# cannot travel (the transformer_engine_cu13 2.20.2 wheel is 276 MB; transformer_engine_torch and flash-attn are
# source-only and would have to be compiled against its torch), so the TE and FP8 cases report "transformer-engine
# is not installed" there until its image gains TE. Device time is 15 minutes a session, 1-2 of them the start:
#
#   here:   bash benchmarks/gpu_wheels.sh build/gpu_wheels                 # 3.7 MiB; build/ is git-ignored
#   there:  PYTHON=/opt/torch/.venv/bin/python3 bash benchmarks/gpu_smoke.sh --wheels build/gpu_wheels \
#               --with-tests --out "$OUT/gpu_smoke.json"       # carry build/gpu_wheels; timeout_s 540 (~7.5 min used)
#
#   benchmarks/gpu_smoke.sh [--wheels DIR] [--with-tests] [--out gpu_smoke.json] [--steps 20] [--numerics-steps 20]
#                           [--cases lf-local-bf16 mcore-local-bf16] [--peak-tflops 989] [--budget-s 420]
#   python benchmarks/gpu_smoke.py --dry-run      # without a GPU: the same machinery on the CPU with llama-tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

WHEELS=""
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="${2:?gpu_smoke: --wheels needs a folder of wheels}"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_smoke: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to measure" >&2
    exit 2
fi
nvidia-smi -L

if [[ -n "$WHEELS" ]]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "gpu_smoke: no wheels in $WHEELS (make them with benchmarks/gpu_wheels.sh on a machine with network)" >&2
        exit 2
    fi
    SITE="${GPU_SMOKE_SITE:-/tmp/loongforge-gpu-site}"
    echo "gpu_smoke: installing ${#wheels[@]} wheels from $WHEELS into $SITE (no index, no dependencies)"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade \
            --target "$SITE" "${wheels[@]}"
    else  # no pip: a wheel is a zip of what goes into site-packages
        echo "gpu_smoke: $PYTHON has no pip; unpacking the wheels instead"
        mkdir -p "$SITE"
        for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# every missing module at once (torch with CUDA, megatron.core, loongforge, loongforge_cuda; TE and flash-attn are
# optional); exit 1 when a required one is missing
"$PYTHON" benchmarks/gpu_smoke.py --check
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
exec "$PYTHON" benchmarks/gpu_smoke.py ${ARGS[@]+"${ARGS[@]}"}
