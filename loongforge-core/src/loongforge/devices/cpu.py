"""The built-in CPU backend: gloo, the CPU generator, process RSS, megatron CPU patches, glibc malloc tuning.

Always available, lowest priority: ``device: auto`` falls back to it when no accelerator plugin is usable.
Importing this module does not import torch (selection and ``loongforge plugins`` stay instant).
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from typing import Any

from loongforge.devices.base import DeviceBackend, MegatronSettings, check_feature

#: Features the CPU backend provides. bf16 works (slowly, through CPU kernels); fp16 training needs a
#: loss scaler megatron implements with CUDA-only kernels; the rest need NVIDIA hardware or libraries.
_SUPPORTED = frozenset({"bf16", "sequence_parallel"})


class CPUBackend(DeviceBackend):
    """Runs megatron-core on CPU processes connected by gloo."""

    name = "cpu"
    priority = 0
    device_type = "cpu"
    dist_backend = "gloo"

    def probe(self) -> tuple[bool, str]:
        """Always available."""
        return True, f"CPU backend is always available ({os.cpu_count()} logical CPUs)"

    def configure_env(self) -> None:
        """Tune glibc malloc for training (unless the user chose the allocator); see
        :mod:`loongforge.devices.cpu_malloc`."""
        from loongforge.devices.cpu_malloc import tune_glibc_malloc

        tune_glibc_malloc()

    def doctor_rows(self) -> list[tuple[str, str]]:
        """What :meth:`configure_env` does to glibc malloc and which GEMM library the linear layers use, in a run
        started from this environment."""
        from loongforge.devices.cpu_malloc import planned_malloc
        from loongforge.devices.megatron_cpu.gemm_choice import planned_kernel

        return [("malloc", planned_malloc()), ("linear GEMM", planned_kernel())]

    def apply_patches(self) -> None:
        """Apply the megatron CPU patches (idempotent); see :mod:`loongforge.devices.megatron_cpu`."""
        from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches

        apply_megatron_cpu_patches()

    def device(self, local_rank: int = 0) -> Any:
        """Every rank computes on ``cpu`` (torch has a single CPU device)."""
        import torch

        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Nothing to select: all ranks share the one CPU device."""

    def synchronize(self) -> None:
        """CPU ops complete before they return."""

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        import torch

        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        """The CPU generator state (``torch.get_rng_state()``)."""
        import torch

        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`get_rng_state`."""
        import torch

        torch.set_rng_state(state["cpu"])

    def memory_stats(self) -> dict[str, int]:
        """Resident set size now and at peak, in bytes (``allocated``/``peak_allocated`` for the CPU)."""
        import psutil

        rss = psutil.Process().memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
        return {"allocated": rss, "peak_allocated": max(peak_bytes, rss), "rss": rss, "peak_rss": peak_bytes}

    def supports(self, feature: str) -> bool:
        """bf16 and sequence parallelism; no fp16 loss scaling, FP8, TE, flash-attn or CUDA graphs."""
        check_feature(feature)
        return feature in _SUPPORTED

    def megatron_settings(self, precision: str = "fp32", **options: Any) -> MegatronSettings:
        """fp32 or bf16, no options: fp16 would need megatron's loss scaler, whose kernels are CUDA-only, so it is
        refused here in one line instead of failing in the first optimizer step."""
        if precision == "fp16":
            raise ValueError("device 'cpu' cannot train in fp16 (megatron's fp16 loss scaling runs CUDA kernels); "
                             "use bf16 or fp32")
        return super().megatron_settings(precision, **options)

    def planner_facts(self) -> dict[str, Any]:
        """The host as the planner sees it: :func:`host_facts`, under this backend's name."""
        return {**host_facts(), "name": self.name}

    def dense_peak_flops(self, precision: str) -> float | None:
        """Measured, not from a datasheet: the best square-GEMM rate in ``precision`` at this process's thread count
        (:func:`~loongforge.devices.matmul_peak.measured_matmul_peak`), so ``mfu`` is the fraction of what this
        machine's matmuls reach with the threads the run was given. Measured once per process and setting."""
        import torch

        return _measured_peak(precision, torch.get_num_threads()) if precision in ("fp32", "bf16") else None

    def spec_provider(self) -> Any:
        """:class:`~loongforge.devices.cpu_spec.CPUSpecProvider` (local linears, SDPA, fused RMSNorm)."""
        from loongforge.devices.cpu_spec import CPUSpecProvider

        return CPUSpecProvider()


@functools.cache
def _measured_peak(precision: str, threads: int) -> float:
    import torch

    from loongforge.devices.matmul_peak import measured_matmul_peak

    return measured_matmul_peak({"fp32": torch.float32, "bf16": torch.bfloat16}[precision], threads)


def host_facts() -> dict[str, Any]:
    """Planner facts of this host's CPU ranks (shared with CPU-type third-party backends).

    Each local process (``LOCAL_WORLD_SIZE``, 1 outside torchrun) gets an equal share of the host memory and,
    when processes outnumber the cores this process may run on, an equal share of the cores' throughput
    (:func:`~loongforge.devices.host.cpu_device_flops`, as the calibration benchmark assumes); links and
    latency are :data:`~loongforge.devices.host.CPU_DEFAULTS`.
    """
    import psutil

    from loongforge.devices.host import CPU_DEFAULTS, cpu_device_flops, local_processes

    local = local_processes(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {**CPU_DEFAULTS, "device_memory": psutil.virtual_memory().total // local, "ranks_per_node": local,
            "device_flops": cpu_device_flops(local, cores)}
