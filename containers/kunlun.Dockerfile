# syntax=docker/dockerfile:1.7
# LoongForge for Kunlunxin P800 XPUs: a Kunlun base image with XPyTorch (Kunlun's torch build, torch_xmlir; Python
# 3.10, torch 2.5.1), megatron-core 0.15.0, loongforge-core 0.5.0 [hf] and loongforge-xpu 0.5.0, as
# plugins/loongforge-xpu/README.md installs them by hand.
#
# XPyTorch's .run installer is not on a public index: put the one Kunlun gave you in a directory and pass that
# directory as the named build context "xpytorch". Build from the repository root, then push:
#   docker buildx build -f containers/kunlun.Dockerfile --build-context xpytorch=/path/to/installers \
#       --build-arg XPYTORCH_RUN=xpytorch-cp310-torch251-ubuntu2004-x64.run -t REGISTRY/loongforge-kunlun:0.5.0 .
#   docker push REGISTRY/loongforge-kunlun:0.5.0
# Run with the XPUs mapped (--device=/dev/xpu0 ... --device=/dev/xpuctrl) as the plugin's README shows.
# tests/core/test_containers.py checks every pin against the repository's pyproject files (docs/cluster.md).

ARG BASE_IMAGE=weiyexu/omni_kunlun:uv_base
FROM ${BASE_IMAGE}

ARG XPYTORCH_RUN=xpytorch-cp310-torch251-ubuntu2004-x64.run
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

# XPyTorch, read from the build context without leaving the installer in a layer; from here on a constraint keeps
# its torch, so no install below can replace it with an ordinary (CUDA) torch.
RUN --mount=type=bind,from=xpytorch,target=/xpytorch \
    bash "/xpytorch/${XPYTORCH_RUN}" \
    && mkdir -p /etc/loongforge \
    && python3 -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /etc/loongforge/constraints.txt
ENV PIP_CONSTRAINT=/etc/loongforge/constraints.txt

# No Transformer Engine or flash-attn on Kunlun (the xpu plugin uses megatron's local layers). megatron-core 0.15.0
# is the newest release that accepts a torch older than 2.6 (and it wants numpy < 2); with an XPyTorch for torch 2.6
# or newer, pin megatron-core==0.16.1 (as the CUDA image does) and numpy==2.2.6 (the last for Python 3.10).
RUN python3 -m pip install megatron-core==0.15.0 numpy==1.26.4 psutil==7.2.2 pluggy==1.7.0 importlib-metadata==9.0.1 \
        pyyaml==6.0.4 safetensors==0.8.0 rich==15.0.0 tensorboard==2.21.0 tokenizers==0.23.3 transformers==5.20.2 \
        jinja2==3.1.6 huggingface_hub==2.4.0 sentencepiece==0.2.3 protobuf==7.36.2 setuptools==84.2.1 wheel==0.48.0

# LoongForge from this checkout, built into wheels and installed by version without an index: the build stops if a
# version here disagrees with a pyproject file or a dependency installed above misses its declared range.
RUN --mount=type=bind,source=loongforge-core,target=/src/loongforge-core,rw \
    --mount=type=bind,source=plugins/loongforge-xpu,target=/src/loongforge-xpu,rw \
    python3 -m pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/wheels /src/loongforge-core /src/loongforge-xpu \
    && python3 -m pip install --no-index --find-links /tmp/wheels "loongforge-core[hf]==0.5.0" "loongforge-xpu==0.5.0" \
    && rm -rf /tmp/wheels

WORKDIR /workspace
CMD ["loongforge", "doctor"]
