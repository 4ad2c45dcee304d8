"""FAKE ``torch.cuda`` surface for CUDA-API backends on CPU-only machines.

Every attribute below mirrors a documented ``torch.cuda`` name (https://pytorch.org/docs/stable/cuda.html); the
device is a CPU ``torch.Generator`` and a few counters. Nothing here computes on a GPU, so tests using it
check how a backend routes calls, never numerics. ``initialized`` turns true on the calls that initialise
CUDA for real (capability queries, set_device, seeding), so probes can be checked not to make them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch


class FakeStream:
    """FAKE ``torch.cuda.Stream``: a context manager that makes itself current on its fake module."""

    def __init__(self, module: FakeCudaModule) -> None:
        self.module = module
        self.waited_on: list[Any] = []

    def __enter__(self) -> FakeStream:
        self.previous, self.module.current_stream = self.module.current_stream, self
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.current_stream = self.previous

    def wait_stream(self, other: Any) -> None:
        self.waited_on.append(other)


class FakeEvent:
    """FAKE ``torch.cuda.Event``: complete once recorded; elapsed time counts recordings in between."""

    def __init__(self, module: FakeCudaModule, enable_timing: bool = False) -> None:
        self.module = module
        self.enable_timing = enable_timing
        self.recorded_at: int | None = None

    def record(self, stream: Any = None) -> None:
        self.module.clock += 1
        self.recorded_at = self.module.clock

    def wait(self, stream: Any = None) -> None:
        assert self.recorded_at is not None, "waiting on an event that was never recorded"

    def synchronize(self) -> None:
        assert self.recorded_at is not None

    def query(self) -> bool:
        return self.recorded_at is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and self.recorded_at is not None and end.recorded_at is not None
        return float(end.recorded_at - self.recorded_at)


class FakeNvtx:
    """FAKE ``torch.cuda.nvtx``: ranges are recorded by name."""

    def __init__(self) -> None:
        self.ranges: list[str] = []

    @contextlib.contextmanager
    def range(self, name: str):  # noqa: A003 - the torch.cuda.nvtx name
        self.ranges.append(name)
        yield


@dataclass(frozen=True)
class FakeDeviceProperties:
    """FAKE ``torch.cuda.get_device_properties()`` result: the fields the backends read."""

    name: str
    major: int
    minor: int
    total_memory: int


class FakeCudaModule:
    """FAKE ``torch.cuda`` with ``device_count`` GPUs of compute capability ``capability``, each called ``name``
    with ``total_memory`` bytes."""

    def __init__(self, capability: tuple[int, int] = (9, 0), device_count: int = 1, name: str = "FAKE GPU",
                 total_memory: int = 80 * 2**30) -> None:
        self.capability = capability
        self._count = device_count
        self.name = name
        self.total_memory = total_memory
        self.initialized = False
        self.current_device_index = 0
        self.current_stream: FakeStream | None = None
        self.clock = 0
        self.synchronize_calls = 0
        self.generator = torch.Generator()
        self.allocated, self.peak, self.reserved = 1024, 4096, 8192
        self.nvtx = FakeNvtx()

    def _init(self) -> None:
        assert self._count > 0, "FAKE torch.cuda: no device"
        self.initialized = True

    def is_available(self) -> bool:
        return self._count > 0

    def device_count(self) -> int:
        return self._count

    def is_initialized(self) -> bool:
        return self.initialized

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        self._init()
        return self.capability

    def current_device(self) -> int:
        self._init()
        return self.current_device_index

    def get_device_properties(self, device: Any = None) -> FakeDeviceProperties:
        self._init()
        return FakeDeviceProperties(self.name, *self.capability, self.total_memory)

    def set_device(self, device: int) -> None:
        self._init()
        if not 0 <= device < self._count:
            raise RuntimeError(f"FAKE torch.cuda: invalid device ordinal {device}")
        self.current_device_index = device

    def synchronize(self, device: Any = None) -> None:
        self._init()
        self.synchronize_calls += 1

    def Stream(self) -> FakeStream:  # noqa: N802 - the torch.cuda name
        return FakeStream(self)

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - the torch.cuda name
        return FakeEvent(self, enable_timing)

    def manual_seed(self, seed: int) -> None:
        self._init()
        self.generator.manual_seed(seed)

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.generator.set_state(state)

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def memory_reserved(self, device: Any = None) -> int:
        return self.reserved

    def rand(self, n: int) -> torch.Tensor:
        """Test helper, not torch.cuda API: ``torch.rand(n, device="cuda")`` drawn from the fake generator."""
        return torch.rand(n, generator=self.generator)
