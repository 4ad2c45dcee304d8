"""The CUDA device backend.

megatron-core targets CUDA natively, so unlike the CPU backend this one patches nothing; its job is
selection (probe without creating a CUDA context), NCCL, per-rank device placement, RNG state for resume,
memory statistics, capability answers by compute capability, and the layer spec provider (Transformer
Engine when it imports, megatron's local torch layers otherwise).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from loongforge.devices.base import DeviceBackend, check_feature

#: Minimum compute capability per feature (Ampere for bf16 and flash-attn, Hopper/Ada for FP8).
_MIN_CAPABILITY = {"bf16": (8, 0), "flash_attn": (8, 0), "fp8": (8, 9)}


class CUDABackend(DeviceBackend):
    name = "cuda"
    priority = 200
    device_type = "cuda"
    dist_backend = "nccl"

    def probe(self) -> tuple[bool, str]:
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed"
        import torch

        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a build without CUDA"
        # is_available() asks the driver (NVML when possible) and does not create a CUDA context.
        if not torch.cuda.is_available():
            return False, "no CUDA device visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
        return True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}"

    def configure_env(self) -> None:
        # megatron-core's TP/SP overlap needs kernels queued in order on one connection per device.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "1")

    def set_device(self, local_rank: int) -> None:
        import torch

        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def stream(self) -> Any:
        import torch

        return torch.cuda.Stream()

    def event(self) -> Any:
        import torch

        return torch.cuda.Event(enable_timing=True)

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.cuda.manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        import torch

        return {"cuda": torch.cuda.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        import torch

        torch.cuda.set_rng_state(state["cuda"])

    def memory_stats(self) -> dict[str, int]:
        import torch

        return {
            "allocated": torch.cuda.memory_allocated(),
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
        }

    def supports(self, feature: str) -> bool:
        check_feature(feature)
        if feature in ("fp16", "cuda_graphs", "sequence_parallel"):
            return True
        if feature == "te":
            return importlib.util.find_spec("transformer_engine") is not None
        import torch

        capability = torch.cuda.get_device_capability()
        if feature == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
            return False
        if feature == "fp8" and not self.supports("te"):
            return False
        return capability >= _MIN_CAPABILITY[feature]

    def profiler_range(self, name: str) -> Any:
        import torch

        return torch.cuda.nvtx.range(name)

    def spec_provider(self) -> Any:
        if self.supports("te"):
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            return TESpecProvider()
        print("loongforge-cuda: transformer-engine not installed; using megatron-core's local layers "
              "(pip install 'loongforge-cuda[te]' for fused kernels)")
        from megatron.core.models.backends import LocalSpecProvider

        return LocalSpecProvider()
