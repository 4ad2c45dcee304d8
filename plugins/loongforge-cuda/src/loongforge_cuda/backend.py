"""The CUDA device backend.

megatron-core targets CUDA natively, so unlike the CPU backend this one patches nothing. Its job is selection
(probe without creating a CUDA context), NCCL, per-rank placement, RNG state for resume and memory statistics
(all through ``torch.cuda``, see :class:`~loongforge.devices.base.DeviceModuleBackend`), capability answers by
compute capability, the layer spec provider (Transformer Engine when it imports, megatron's local layers
otherwise) and the megatron settings for precision, attention, CUDA graphs and overlap.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from loongforge.devices.base import DeviceModuleBackend, check_feature
from loongforge.devices.torch_build import TorchBuild, installed_torch_build

from loongforge_cuda.capability import feature_supported, installed, te_recipe_classes
from loongforge_cuda.settings import CUDAMegatronSettings, CUDAOptions, resolve_settings


class CUDABackend(DeviceModuleBackend):
    """NVIDIA GPUs through ``torch.cuda`` and NCCL."""

    name = "cuda"
    priority = 200
    device_type = "cuda"
    dist_backend = "nccl"
    options_type = CUDAOptions

    def probe(self) -> tuple[bool, str]:
        """Available when torch sees a CUDA device; ``is_available``/``device_count`` create no context. A torch
        built without CUDA is ruled out from its version file, without importing torch (``check`` stays fast)."""
        build = self.torch_build()
        if build.cuda is None:
            return False, (f"torch {build.version} is a build without CUDA; on a GPU host, install a CUDA "
                           "build of torch (pytorch.org/get-started/locally)")
        cuda = self.device_module()
        if not cuda.is_available():
            return False, ("no CUDA device visible: check the driver with nvidia-smi, and that CUDA_VISIBLE_DEVICES "
                           "(now " + os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + ") names a device")
        return True, f"{cuda.device_count()} CUDA device(s), CUDA {build.cuda}"

    def torch_build(self) -> TorchBuild:
        """What the installed torch was compiled against (tests substitute a CUDA build, with :meth:`device_module`)."""
        return installed_torch_build()

    def configure_env(self) -> None:
        """Defaults megatron-core expects on GPUs; a value the user set is never replaced.

        ``CUDA_DEVICE_MAX_CONNECTIONS=1`` keeps kernels in issue order on one hardware queue, which TP/SP
        communication overlap relies on; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` makes a failed collective abort
        the job instead of hanging it.
        """
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

    def capability(self) -> tuple[int, int]:
        """The current device's compute capability (initialises CUDA: call after selection, never in probe)."""
        major, minor = self.device_module().get_device_capability()
        return int(major), int(minor)

    def supports(self, feature: str) -> bool:
        """By compute capability and installed libraries; every feature is ``False`` without a visible GPU."""
        check_feature(feature)
        if not self.device_module().is_available():
            return False
        return feature_supported(feature, self.capability(), te=installed("transformer_engine"),
                                 flash_attn=installed("flash_attn"))

    def planner_facts(self) -> dict[str, Any]:
        """The current GPU for the planner: its memory, ranks per node (``LOCAL_WORLD_SIZE``, else the visible
        GPUs) and the datasheet-based speeds of :mod:`loongforge_cuda.planner_facts` (initialises CUDA, like
        :meth:`capability`: the trainer asks after selection)."""
        from loongforge.planner.hardware import module_device_facts

        from loongforge_cuda.planner_facts import gpu_speeds

        module = self.device_module()
        properties = module.get_device_properties(module.current_device())
        return {**module_device_facts(module), **gpu_speeds(properties.name, (properties.major, properties.minor))}

    def dense_peak_flops(self, precision: str) -> float | None:
        """The current GPU's datasheet dense peak for ``precision`` (:func:`loongforge_cuda.planner_facts.dense_peak`:
        989 TFLOP/s bf16 on an H100/H200 SXM; none for fp32 or an unlisted GPU)."""
        from loongforge_cuda.planner_facts import dense_peak

        module = self.device_module()
        properties = module.get_device_properties(module.current_device())
        return dense_peak(properties.name, (properties.major, properties.minor), precision)

    def profiler_range(self, name: str) -> Any:
        """An NVTX range, which Nsight Systems shows on the timeline."""
        return self.device_module().nvtx.range(name)

    #: Layers the run's settings chose (``device_options.layers``); ``None`` until ``megatron_settings`` ran.
    _layers: str | None = None

    def spec_provider(self) -> Any:
        """Transformer Engine's spec provider when TE is installed (and the run did not ask for
        ``layers: local``), else megatron's local layers with torch SDPA attention
        (:class:`~loongforge_cuda.local_spec.LocalSDPASpecProvider`; a notice when TE is simply missing), whose packed
        rows go through flash-attn's varlen kernel when ``supports("flash_attn")``."""
        from loongforge_cuda.local_spec import LocalSDPASpecProvider

        if self._layers != "local":
            if installed("transformer_engine"):
                from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

                return TESpecProvider()
            _local_layers_notice()
        return LocalSDPASpecProvider(flash_varlen=self.supports("flash_attn"))

    def megatron_settings(self, precision: str = "fp32", **options: Any) -> CUDAMegatronSettings:
        """Precision (bf16, FP8 with a TE recipe), attention backend, CUDA graphs and overlap switches.

        See :data:`loongforge_cuda.settings.OPTIONS` for the options and their defaults.
        """
        settings = resolve_settings(
            precision, options, capability=self.capability(), te_recipes=te_recipe_classes(),
            te=installed("transformer_engine"), flash_attn=installed("flash_attn"),
        )
        self._layers = settings.layers  # the trainer resolves settings before it builds the model
        return settings

    def doctor_rows(self) -> list[tuple[str, str]]:
        """CUDA build, visible devices and the optional GPU libraries (no context is created)."""
        import torch

        cuda = self.device_module()
        return [
            ("torch CUDA build", torch.version.cuda or "none (CPU build of torch)"),
            ("visible devices", str(cuda.device_count()) if cuda.is_available() else "0"),
            ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")),
            ("transformer-engine", _dist_version("transformer-engine", "loongforge-cuda[te]")),
            ("flash-attn", _dist_version("flash-attn", "loongforge-cuda[flash]")),
        ]


def _dist_version(dist: str, extra: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return f"not installed (pip install '{extra}')"


@functools.cache
def _local_layers_notice() -> None:
    """Say once per process that the fused TE layers are not in use, and how to get them."""
    print("loongforge-cuda: transformer-engine is not installed; building megatron-core's local layers "
          "(pip install 'loongforge-cuda[te]' for fused kernels and FP8)", file=sys.stderr)
