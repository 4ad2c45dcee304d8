"""The device-ops protocol every hardware plugin implements.

Trainer, checkpoint and model code call these methods and never ``torch.cuda`` directly, so that CPU, CUDA,
Kunlun XPU and third-party accelerators are interchangeable plugins. A backend is registered under its
``name`` through ``loongforge_register_devices(registry)``; :func:`loongforge.devices.selection.select_backend`
instantiates it with no arguments, so ``__init__`` must be cheap and must not touch the device.

This module imports no torch at import time: listing plugins and probing backends must stay instant.
"""

from __future__ import annotations

import abc
import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

#: Features a backend may be asked about through :meth:`DeviceBackend.supports`.
#: ``streams``: work runs on concurrent device streams (megatron-core's stream-based communication overlap).
FEATURES: tuple[str, ...] = ("bf16", "fp16", "fp8", "te", "flash_attn", "cuda_graphs", "sequence_parallel",
                             "streams")


class DeviceBackend(abc.ABC):
    """Device operations for one kind of accelerator (or the CPU).

    Class attributes:
        name: registry name (``"cpu"``, ``"cuda"``, ``"xpu"``); also stored in checkpoint metadata.
        priority: order for ``device: auto`` -- the highest-priority available backend wins
            (xpu 300 > cuda 200 > cpu 0; Kunlun's torch makes ``torch.cuda.is_available()`` true, so it
            must be probed before CUDA).
        device_type: the torch device type string tensors are created with (``"cpu"``, ``"cuda"``).
        dist_backend: the ``torch.distributed`` backend to initialise (``"gloo"``, ``"nccl"``, ``"xccl"``).
        options_type: the dataclass of the config's ``device_options:`` section for this backend (the keyword
            arguments :meth:`megatron_settings` takes), checked by core like its own sections before a run
            starts (unknown key with did-you-mean, types); ``None``: the backend takes no options.
    """

    name: str = ""
    priority: int = 0
    device_type: str = ""
    dist_backend: str = ""
    options_type: ClassVar[type | None] = None

    # -- selection and setup -------------------------------------------------------------------------

    @abc.abstractmethod
    def probe(self) -> tuple[bool, str]:
        """Whether this backend can run here, and a one-line human reason either way.

        Must be cheap and side-effect free: never initialise the device, create a context or allocate
        memory (``auto`` selection probes every registered backend, and the CLI's ``doctor`` prints the
        reasons). Checking that a vendor module imports and reports devices is the expected depth.
        """

    def configure_env(self) -> None:  # noqa: B027 -- optional hook, empty by default
        """Set environment variables the runtime reads at initialisation (allocator, NCCL/XCCL knobs).

        Called before ``torch.distributed`` is initialised. Use ``os.environ.setdefault`` only, so that a
        user's explicit setting always wins. The default sets nothing.
        """

    def apply_patches(self) -> None:  # noqa: B027 -- optional hook, empty by default
        """Patch third-party libraries (megatron-core, torch) for this device.

        Called once per process after selection and before any model or optimizer is built; must be
        idempotent (a second call does nothing) because tests and notebooks build several models. The
        default patches nothing.
        """

    # -- placement and synchronisation ---------------------------------------------------------------

    def device(self, local_rank: int = 0) -> torch.device:
        """The ``torch.device`` that a process with this node-local rank computes on."""
        import torch

        return torch.device(self.device_type, local_rank)

    @abc.abstractmethod
    def set_device(self, local_rank: int) -> None:
        """Make ``device(local_rank)`` the current device of this process (before creating tensors)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device has finished (used around timings)."""

    def stream(self) -> Any:
        """A new side stream usable as a context manager (``with backend.stream(): ...``).

        Backends without streams return an object whose context does nothing and whose ``wait_stream``,
        ``synchronize`` and ``record_event`` are no-ops.
        """
        return NullStream()

    def event(self) -> Any:
        """A new event with ``record()``, ``wait()``, ``synchronize()`` and ``query()``; no-ops without streams."""
        return NullStream()

    def current_stream(self) -> Any:
        """The stream the current device computes on, so that side-stream work can be ordered against it
        (``side.wait_stream(backend.current_stream())``); backends without streams return a no-op stand-in."""
        return NullStream()

    def host_empty_strided(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``size``/``stride`` to copy a device tensor into and back from
        (activation offload). Accelerators return page-locked memory, without which their copies cannot run
        asynchronously on a side stream; the default is ordinary host memory (on the CPU backend a separate buffer
        in the same memory, so the offload path still copies and can be tested)."""
        import torch

        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    # -- random numbers ------------------------------------------------------------------------------

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device's default generator (the one dropout and device-side init draw from)."""

    @abc.abstractmethod
    def get_rng_state(self) -> dict[str, Any]:
        """The device generator state, as a picklable dict, for bit-exact resume from checkpoints."""

    @abc.abstractmethod
    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore a state returned by :meth:`get_rng_state` (from the same backend)."""

    # -- introspection ------------------------------------------------------------------------------

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Memory in bytes for logs and benchmarks; at least ``allocated`` and ``peak_allocated``.

        Accelerators report device memory; the CPU backend reports process resident memory.
        """

    @abc.abstractmethod
    def supports(self, feature: str) -> bool:
        """Whether ``feature`` (one of :data:`FEATURES`) works on this backend here.

        Used to reject configs early (``precision: fp8`` on a device without FP8) instead of failing deep
        inside a kernel. Unknown feature names raise ``ValueError``.
        """

    def profiler_range(self, name: str) -> AbstractContextManager[Any]:
        """A context manager that labels the enclosed work in profiler traces (NVTX on CUDA).

        The default uses ``torch.profiler.record_function``, which every backend's profiler understands.
        """
        import torch

        return torch.profiler.record_function(name)

    # -- models ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def spec_provider(self) -> Any:
        """The megatron-core ``BackendSpecProvider`` whose modules transformer layers are built from.

        It chooses the linear layers, norms, core attention and MoE expert modules for this device
        (local torch modules on CPU, Transformer Engine modules on CUDA when installed).
        """

    def megatron_settings(self, precision: str = "fp32", **options: Any) -> MegatronSettings:
        """Device-specific megatron settings for a run in ``precision`` (``fp32``/``bf16``/``fp16``/``fp8``).

        The trainer builds its ``TransformerConfig`` and ``DistributedDataParallelConfig`` and adds
        ``settings.transformer_config_kwargs()`` / ``settings.ddp_config_kwargs()``, building parameters in
        ``settings.params_dtype``. ``options`` are the device's own switches (FP8 recipe, CUDA graphs,
        communication overlap, ...), so that such knobs live in the plugin that understands them instead of in
        core. The default accepts the precisions every backend can express through ``params_dtype`` and no
        options: an unknown option or ``fp8`` on a device without it is an error here, before any model is built.
        """
        if options:
            raise ValueError(f"device '{self.name}' takes no megatron options; got {', '.join(sorted(options))}")
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"device '{self.name}' does not support precision '{precision}' (fp32, bf16, fp16)")
        return MegatronSettings(params_dtype=precision)

    # -- reporting ----------------------------------------------------------------------------------

    def doctor_rows(self) -> list[tuple[str, str]]:
        """``(item, value)`` rows ``loongforge doctor`` prints in a section of its own for this backend.

        For the vendor stack behind the device (runtime versions, device nodes, environment knobs) that the
        one-line probe reason cannot hold. Same rules as :meth:`probe`: cheap, never initialise the device.
        The default has nothing to add.
        """
        return []

    def dense_peak_flops(self, precision: str) -> float | None:
        """One device's dense matmul peak in FLOP/s for ``precision`` (``fp32``, ``bf16``, ``fp16``), the
        denominator of the model-FLOPs utilisation (``mfu``) the training metrics report; ``None`` when the backend
        has no figure for this device and precision, and the metrics then show achieved ``tflops`` only.

        A datasheet figure (the CUDA plugin's table: dense, no sparsity) or, where none means much, a measurement
        (the CPU backend's GEMM probe). Called once per run after selection, so it may initialise the device.
        The default knows no figure."""
        return None

    def planner_facts(self) -> dict[str, Any]:
        """What the parallel planner (``loongforge plan``, ``parallel: auto``) should assume about this device.

        Any of the keys of ``loongforge.planner.hardware.ClusterSpec`` but the device count: ``device_memory``
        (bytes), ``ranks_per_node``, ``device_flops`` (*achieved* dense FLOP/s in the training precision),
        ``intra_node_bandwidth`` / ``inter_node_bandwidth`` (per-device collective bytes/s), ``latency`` (s per
        collective) and ``name`` (say where the figures come from); another key is an error. Called after
        selection, so it may initialise the device (:meth:`probe` never may). The default knows only the name,
        so users must state ``parallel.planner.device_memory``; :class:`DeviceModuleBackend` reads its device.
        """
        return {"name": self.name or type(self).__name__}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@dataclass(frozen=True)
class MegatronSettings:
    """What a device adds to megatron's configs for one run (see :meth:`DeviceBackend.megatron_settings`).

    Backends with settings of their own (FP8 recipes, CUDA graphs) subclass this frozen dataclass with typed
    fields and override the two ``*_kwargs`` methods; this base adds nothing beyond the parameter dtype.
    """

    #: dtype parameters are built in (``fp32``/``bf16``/``fp16``); FP8 runs keep ``bf16`` parameters.
    params_dtype: str = "fp32"

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for ``megatron.core.transformer.TransformerConfig``."""
        return {}

    def ddp_config_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for ``megatron.core.distributed.DistributedDataParallelConfig``."""
        return {}


class DeviceModuleBackend(DeviceBackend):
    """A backend whose device is driven through a ``torch.cuda``-style module.

    ``torch.cuda``, ``torch.xpu``, ``torch.npu`` (torch_npu) and Kunlun's torch_xmlir (which serves the
    ``torch.cuda`` API itself) share one API for devices, streams, events, generators and allocator
    statistics, so a backend for such a stack only writes its probe, capabilities and spec provider. All
    device access goes through :meth:`device_module`, which is also where tests substitute a fake module.
    """

    def device_module(self) -> Any:
        """The torch device module for :attr:`device_type` (``torch.cuda`` for ``"cuda"``)."""
        import torch

        return torch.get_device_module(self.device_type)

    def planner_facts(self) -> dict[str, Any]:
        """The current device's memory and the device count, with speeds nobody has measured: the deliberately
        low :data:`~loongforge.devices.host.UNKNOWN_ACCELERATOR` figures (override with a table of your own)."""
        from loongforge.devices.host import UNKNOWN_ACCELERATOR, module_device_facts, unknown_device_name

        name = self.name or type(self).__name__
        return {**module_device_facts(self.device_module()), **UNKNOWN_ACCELERATOR, "name": unknown_device_name(name)}

    def set_device(self, local_rank: int) -> None:
        """``<module>.set_device(local_rank)``."""
        self.device_module().set_device(local_rank)

    def synchronize(self) -> None:
        """``<module>.synchronize()`` on the current device."""
        self.device_module().synchronize()

    def stream(self) -> Any:
        """A new ``<module>.Stream()`` (a context manager that makes it current)."""
        return self.device_module().Stream()

    def event(self) -> Any:
        """A new timing-enabled ``<module>.Event``."""
        return self.device_module().Event(enable_timing=True)

    def current_stream(self) -> Any:
        """``<module>.current_stream()``."""
        return self.device_module().current_stream()

    def host_empty_strided(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (``pin_memory=True``): device copies from and to it run asynchronously."""
        import torch

        return torch.empty_strided(size, stride, dtype=dtype, device="cpu", pin_memory=True)

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's default generator."""
        self.device_module().manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        """The current device's generator state, keyed by device type."""
        return {self.device_type: self.device_module().get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`get_rng_state`."""
        self.device_module().set_rng_state(state[self.device_type])

    def memory_stats(self) -> dict[str, int]:
        """Allocator statistics of the current device, in bytes."""
        module = self.device_module()
        return {
            "allocated": int(module.memory_allocated()),
            "peak_allocated": int(module.max_memory_allocated()),
            "reserved": int(module.memory_reserved()),
        }


def check_feature(feature: str) -> None:
    """Raise ``ValueError`` for a feature name outside :data:`FEATURES` (shared by ``supports`` overrides)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown device feature '{feature}'; known: {', '.join(FEATURES)}")


class NullStream(contextlib.nullcontext):  # type: ignore[type-arg]
    """Stream/event stand-in for devices that execute in program order: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # accepts torch.cuda.Stream/Event arguments
        super().__init__()

    def wait_stream(self, other: Any) -> None:
        """No-op."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> NullStream:
        """Return an always-complete event."""
        return NullStream()

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, other: Any) -> float:
        """Events without timestamps report zero rather than a made-up duration."""
        return 0.0
