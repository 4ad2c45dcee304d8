#!/usr/bin/env bash
# The wheels a bare GPU machine needs for benchmarks/gpu_smoke.sh --wheels OUTDIR, made here (a machine with network;
# no GPU needed) and carried there inside the repository's working tree (64 MiB in all, the tree's ~6 MB included).
#
# The lent H200 has Python 3.12 with torch 2.11.0+cu130, triton, transformers, numpy, packaging, pluggy, pyyaml,
# safetensors, rich, tensorboard, psutil and pytest, and no network; it lacks (and this fills OUTDIR with):
#   - megatron-core, pinned to the version installed here, binary for CPython 3.12 manylinux x86_64 (~2.6 MB);
#   - importlib-metadata (the version installed here) and its pure-Python dependencies (zipp, lazy-importer);
#   - loongforge-core and loongforge-cuda, built from this working tree (pip wheel --no-deps --no-build-isolation,
#     from a clean copy, so no stale build/ folder leaks into the wheel and nothing is written into the tree).
# Transformer Engine and flash-attn are not fetched: TE's transformer_engine_cu13 wheel alone is 276 MB (over the
# limit) and transformer_engine_torch and flash-attn are source-only (they would have to be compiled against the
# device's torch), so gpu_smoke lists their cases as not run.
#
# It empties OUTDIR's *.whl first, prints each wheel and the total, and fails when the total exceeds --limit-mib
# (default 60). Keep OUTDIR in an ignored folder (build/ is) and carry it: run(carry=["build/gpu_wheels"]).
#
#   bash benchmarks/gpu_wheels.sh build/gpu_wheels [--limit-mib 60] [--python-version 3.12]
#
# Environment: PYTHON (default python3; the local versions are read from it), GPU_WHEELS_PIP (the pip command,
# default "$PYTHON -m pip"; the tests put a fake one there).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

OUT=""
LIMIT_MIB=60
PY_VERSION=3.12
while [[ $# -gt 0 ]]; do
    case "$1" in
        --limit-mib) LIMIT_MIB="${2:?gpu_wheels: --limit-mib needs a number}"; shift 2 ;;
        --limit-mib=*) LIMIT_MIB="${1#--limit-mib=}"; shift ;;
        --python-version) PY_VERSION="${2:?gpu_wheels: --python-version needs a version}"; shift 2 ;;
        --python-version=*) PY_VERSION="${1#--python-version=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_wheels: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [[ -z "$OUT" ]] || { echo "gpu_wheels: one OUTDIR, got '$OUT' and '$1'" >&2; exit 2; }; OUT="$1"; shift ;;
    esac
done
if [[ -z "$OUT" ]]; then
    usage >&2
    exit 2
fi
if ! [[ "$LIMIT_MIB" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "gpu_wheels: --limit-mib takes a number of MiB, got '$LIMIT_MIB'" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
read -r -a PIP <<< "${GPU_WHEELS_PIP:-$PYTHON -m pip}"

local_version() {
    "$PYTHON" -c 'import sys; from importlib import metadata; print(metadata.version(sys.argv[1]))' "$1" 2>/dev/null \
        || { echo "gpu_wheels: $1 is not installed in $PYTHON; its version is what the device gets" >&2; exit 1; }
}
MCORE_VERSION="$(local_version megatron-core)"
IMPORTLIB_METADATA_VERSION="$(local_version importlib-metadata)"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/*.whl  # a fresh set: a stale wheel (an older loongforge) would be installed too
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT

# the device's interpreter: CPython $PY_VERSION on x86_64 Linux, binary wheels only
TARGET=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
echo "gpu_wheels: megatron-core==$MCORE_VERSION (cp${PY_VERSION/./}, manylinux x86_64)"
"${PIP[@]}" download --quiet --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$OUT" \
    "megatron-core==$MCORE_VERSION"
echo "gpu_wheels: importlib-metadata==$IMPORTLIB_METADATA_VERSION and its dependencies"
"${PIP[@]}" download --quiet --disable-pip-version-check "${TARGET[@]}" -d "$OUT" \
    "importlib-metadata==$IMPORTLIB_METADATA_VERSION"

echo "gpu_wheels: loongforge-core and loongforge-cuda from $ROOT"
# a clean copy of the two projects: setuptools' build/ folder keeps files since renamed or deleted
tar -C "$ROOT" --exclude=build --exclude='*.egg-info' --exclude=__pycache__ --exclude='*.pyc' \
    -cf - loongforge-core plugins/loongforge-cuda | tar -C "$BUILD" -xf -
"${PIP[@]}" wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$OUT" \
    "$BUILD/loongforge-core" "$BUILD/plugins/loongforge-cuda"

shopt -s nullglob
wheels=("$OUT"/*.whl)
shopt -u nullglob
if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "gpu_wheels: no wheels in $OUT after the downloads and builds" >&2
    exit 1
fi
total=0
for wheel in "${wheels[@]}"; do
    size=$(wc -c < "$wheel")
    total=$((total + size))
    awk -v s="$size" -v n="$(basename "$wheel")" 'BEGIN { printf "  %8.2f MiB  %s\n", s / 1048576, n }'
done
if awk -v t="$total" -v l="$LIMIT_MIB" 'BEGIN { exit !(t > l * 1048576) }'; then
    awk -v t="$total" -v l="$LIMIT_MIB" -v n="${#wheels[@]}" -v o="$OUT" 'BEGIN {
        printf "gpu_wheels: the %d wheels in %s total %.2f MiB, over the limit of %s MiB (the device takes 64 MiB " \
               "in all, the working tree included)\n", n, o, t / 1048576, l }' >&2
    exit 1
fi
awk -v t="$total" -v l="$LIMIT_MIB" -v n="${#wheels[@]}" -v o="$OUT" \
    'BEGIN { printf "gpu_wheels: %d wheels in %s, total %.2f MiB (limit %s MiB)\n", n, o, t / 1048576, l }'
