# syntax=docker/dockerfile:1.7
# LoongForge for NVIDIA GPUs: CUDA 13.0 + cuDNN (Ubuntu 24.04, Python 3.12), torch 2.13.0, Transformer Engine
# 2.20.2, flash-attn 2.8.3.post2, megatron-core 0.16.1, loongforge-core 0.5.0 [hf] and loongforge-cuda 0.6.0 [te,flash].
#
# Build from the repository root (BuildKit: Docker 23+ or docker buildx), then push:
#   docker build -f containers/cuda.Dockerfile -t REGISTRY/loongforge-cuda:0.6.0 .
#   docker push REGISTRY/loongforge-cuda:0.6.0
# Transformer Engine's PyTorch extension and flash-attn compile here against this torch (an hour or more; --build-arg
# MAX_JOBS=N bounds the parallel compilers, about 4 GB of memory each; CUDA_ARCHS lists the GPU generations).
# tests/core/test_containers.py checks every pin against the repository's pyproject files (docs/cluster.md).

ARG BASE_IMAGE=nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ARG MAX_JOBS=8
ARG CUDA_ARCHS="80;90;100"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/loongforge \
    PATH=/opt/loongforge/bin:${PATH}

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/loongforge

# torch first, with what the extensions below build with; from here on a constraint keeps this torch, so no later
# install can swap it for another build the extensions were not compiled against.
RUN pip install torch==2.13.0 numpy==2.4.6 psutil==7.2.2 setuptools==84.2.1 wheel==0.48.0 packaging==26.4 \
        ninja==1.13.2 cmake==4.4.5 pybind11==3.1.0 \
    && python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /opt/loongforge/constraints.txt
ENV PIP_CONSTRAINT=/opt/loongforge/constraints.txt

RUN NVTE_CUDA_ARCHS="${CUDA_ARCHS}" MAX_JOBS=${MAX_JOBS} \
    pip install --no-build-isolation "transformer-engine[pytorch,core-cu13]==2.20.2"
RUN FLASH_ATTN_CUDA_ARCHS="${CUDA_ARCHS}" MAX_JOBS=${MAX_JOBS} \
    pip install --no-build-isolation flash-attn==2.8.3.post2 einops==0.8.2

RUN pip install megatron-core==0.16.1 pluggy==1.7.0 importlib-metadata==10.2.0 pyyaml==6.0.4 safetensors==0.8.0 \
        rich==15.0.0 tensorboard==2.21.0 tokenizers==0.23.3 transformers==5.24.0 jinja2==3.1.6 \
        huggingface_hub==2.4.0 sentencepiece==0.2.3 protobuf==7.36.2

# LoongForge from this checkout, built into wheels and installed by version without an index: the build stops if a
# version here disagrees with a pyproject file or a dependency installed above misses its declared range.
RUN --mount=type=bind,source=loongforge-core,target=/src/loongforge-core,rw \
    --mount=type=bind,source=plugins/loongforge-cuda,target=/src/loongforge-cuda,rw \
    pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/wheels /src/loongforge-core /src/loongforge-cuda \
    && pip install --no-index --find-links /tmp/wheels "loongforge-core[hf]==0.5.0" "loongforge-cuda[te,flash]==0.6.0" \
    && rm -rf /tmp/wheels

WORKDIR /workspace
CMD ["loongforge", "doctor"]
