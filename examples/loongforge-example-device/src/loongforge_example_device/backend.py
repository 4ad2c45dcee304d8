"""A complete device backend a hardware vendor can copy: CPU compute with deterministic algorithms.

Every method of :class:`loongforge.devices.base.DeviceBackend` is implemented here on purpose, each with the
question a real accelerator port must answer in its place. Compute runs on the CPU through LoongForge's
megatron CPU patches, so the package trains for real on any machine -- which is what lets its own test suite
(``tests/``) run :class:`loongforge.testing.device_suite.DeviceBackendSuite` in CI.

For a ``torch.cuda``-style vendor module (``torch.npu``, ``torch.xpu``, ...) subclass
:class:`loongforge.devices.base.DeviceModuleBackend` instead and only write probe/supports/spec_provider.
"""

from __future__ import annotations

import os
from typing import Any

from loongforge.devices.base import DeviceBackend, check_feature

#: Features this backend provides (a real port answers from the device's generation and installed libraries).
_SUPPORTED = frozenset({"bf16", "sequence_parallel"})


class DeterministicCPUBackend(DeviceBackend):
    """CPU processes connected by gloo, with ``torch.use_deterministic_algorithms(True)``."""

    #: The name configs use (``device: cpu-deterministic``) and checkpoints record.
    name = "cpu-deterministic"
    #: Below the built-in CPU backend (0): ``device: auto`` never picks an example; a real accelerator
    #: uses a priority above cpu (and above cuda, 200, when its runtime makes torch.cuda answer too).
    priority = -10
    device_type = "cpu"
    dist_backend = "gloo"

    def probe(self) -> tuple[bool, str]:
        """Real port: check the vendor package is importable (``importlib.util.find_spec``) and device nodes
        exist -- never import a runtime that initialises the device or reads the environment."""
        return True, "deterministic CPU example backend is always available"

    def configure_env(self) -> None:
        """Real port: runtime/collective defaults via ``os.environ.setdefault`` only (the user wins).

        Here: a deterministic reduction order in oneDNN's matmuls when nobody chose otherwise.
        """
        os.environ.setdefault("ONEDNN_DEFAULT_FPMATH_MODE", "STRICT")

    def apply_patches(self) -> None:
        """Real port: patch megatron-core/torch for the device, once (must be idempotent)."""
        import torch
        from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches

        apply_megatron_cpu_patches()
        torch.use_deterministic_algorithms(True)

    def device(self, local_rank: int = 0) -> Any:
        """All ranks share the single torch CPU device."""
        import torch

        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Nothing to select on the CPU (a real port: ``torch.<vendor>.set_device(local_rank)``)."""

    def synchronize(self) -> None:
        """CPU ops finish before they return (a real port waits for the device queue)."""

    def manual_seed(self, seed: int) -> None:
        """Seed the generator dropout and initialisation draw from."""
        import torch

        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        """Picklable generator state; checkpoints store it for bit-exact resume."""
        import torch

        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`get_rng_state` result."""
        import torch

        torch.set_rng_state(state["cpu"])

    def memory_stats(self) -> dict[str, int]:
        """Process resident memory (a real port: the device allocator's allocated/peak bytes)."""
        import psutil

        rss = psutil.Process().memory_info().rss
        return {"allocated": rss, "peak_allocated": rss}

    def supports(self, feature: str) -> bool:
        """bf16 and sequence parallelism; unknown feature names raise ``ValueError`` (``check_feature``)."""
        check_feature(feature)
        return feature in _SUPPORTED

    def spec_provider(self) -> Any:
        """Which megatron modules build the layers (a real port: its fused kernels, or megatron's local ones)."""
        from loongforge.devices.cpu_spec import CPUSpecProvider

        return CPUSpecProvider()

    def doctor_rows(self) -> list[tuple[str, str]]:
        """Extra lines for ``loongforge doctor`` (a real port: runtime version, device nodes, env knobs)."""
        return [("deterministic algorithms", "on after apply_patches"),
                ("ONEDNN_DEFAULT_FPMATH_MODE", os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "(unset)"))]
