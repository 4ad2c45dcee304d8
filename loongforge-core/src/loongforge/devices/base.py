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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Features a backend may be asked about through :meth:`DeviceBackend.supports`.
FEATURES: tuple[str, ...] = ("bf16", "fp16", "fp8", "te", "flash_attn", "cuda_graphs", "sequence_parallel")


class DeviceBackend(abc.ABC):
    """Device operations for one kind of accelerator (or the CPU).

    Class attributes:
        name: registry name (``"cpu"``, ``"cuda"``, ``"xpu"``); also stored in checkpoint metadata.
        priority: order for ``device: auto`` -- the highest-priority available backend wins
            (xpu 300 > cuda 200 > cpu 0; Kunlun's torch makes ``torch.cuda.is_available()`` true, so it
            must be probed before CUDA).
        device_type: the torch device type string tensors are created with (``"cpu"``, ``"cuda"``).
        dist_backend: the ``torch.distributed`` backend to initialise (``"gloo"``, ``"nccl"``, ``"xccl"``).
    """

    name: str = ""
    priority: int = 0
    device_type: str = ""
    dist_backend: str = ""

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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


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
