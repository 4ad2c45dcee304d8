"""What the planner needs to know about the machines: memory per device, devices per node, speeds.

These facts come from three places, most specific first: explicit flags / config keys, the device backend
(:func:`device_facts`: each backend's ``planner_facts()``, e.g. the CUDA plugin's table of datasheet figures
by GPU model), and defaults for a current datacenter GPU (NVLink within a node, InfiniBand between nodes).
Speeds are effective figures (what a well-tuned run achieves), which calibration
(:mod:`loongforge.planner.calibrate`) replaces with measured ones.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any

from loongforge.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

GIB = 2**30


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes -> bytes (GB is 10^9, GiB 2^30)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (e.g. 80GiB, 96GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in GiB/MiB with three significant digits (negative sizes keep their sign)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{sign}{value:.0f} {unit}" if value >= 100 else f"{sign}{value:.3g} {unit}"
    return f"{sign}{n:.0f} B"


@dataclass(frozen=True)
class ClusterSpec:
    """The devices a run is planned for.

    ``device_flops`` is the *achieved* dense matmul throughput of one device in the training precision
    (FLOP/s); ``intra_node_bandwidth``/``inter_node_bandwidth`` are per-device bus bandwidths (bytes/s) of
    collectives inside a node and across nodes; ``latency`` is a per-collective fixed cost (s).
    """

    num_devices: int
    device_memory: int
    ranks_per_node: int = 8
    device_flops: float = 400e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    latency: float = 20e-6
    name: str = "gpu"

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.ranks_per_node < 1:
            raise ConfigError(f"need >= 1 device and >= 1 rank per node, got {self.num_devices} and "
                              f"{self.ranks_per_node}")
        if self.device_memory <= 0:
            raise ConfigError(f"device memory must be positive, got {self.device_memory}")

    @property
    def node_size(self) -> int:
        """Ranks that share the fast intra-node link (no more than there are devices)."""
        return min(self.ranks_per_node, self.num_devices)

    def with_(self, **changes: Any) -> ClusterSpec:
        return replace(self, **changes)


#: A CPU "device": a process on a shared host; memory bandwidth stands in for the link (gloo over shared
#: memory/TCP loopback), and the throughput figure is what fp32 matmuls achieve per process with a core to
#: itself (:func:`cpu_device_flops` shares it out when processes outnumber cores).
CPU_DEFAULTS = {"device_flops": 30e9, "intra_node_bandwidth": 2e9, "inter_node_bandwidth": 1e9, "latency": 2e-4}

#: Speeds for an accelerator nobody has described to the planner -- an unknown GPU, a Kunlun XPU (no
#: published figures we can cite) or a third-party backend without ``planner_facts``. Deliberately low, so
#: an unknown device is never planned as faster than it is: 50 TFLOP/s achieved (half of a 100 TFLOP/s
#: peak, below every bf16 datacenter GPU of the last generations), PCIe Gen4 x16 inside a node (32 GB/s
#: per direction), one 100 Gb/s port per device across nodes, 50 us per collective.
UNKNOWN_ACCELERATOR = {"device_flops": 50e12, "intra_node_bandwidth": 32e9, "inter_node_bandwidth": 12.5e9,
                       "latency": 50e-6}

#: The keys a backend's ``planner_facts()`` may return (every :class:`ClusterSpec` field but the count).
FACT_KEYS = frozenset(ClusterSpec.__dataclass_fields__) - {"num_devices"}


def cpu_device_flops(processes: int, cores: int) -> float:
    """Per-process throughput of ``processes`` single-threaded ranks sharing ``cores`` cores."""
    return CPU_DEFAULTS["device_flops"] * min(1.0, cores / max(1, processes))


def local_processes(default: int) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else ``default``."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return max(1, int(value)) if value else default


def unknown_device_name(name: str) -> str:
    """How a device on :data:`UNKNOWN_ACCELERATOR` figures is named in plans and logs."""
    return f"{name} (unknown: conservative figures)"


def module_device_facts(module: Any) -> dict[str, Any]:
    """Memory of the current device and ranks per node from a ``torch.cuda``-style module.

    Asking for device properties initialises the device runtime, so call this after backend selection (the
    trainer plans after it has chosen the device; ``probe`` must never get here).
    """
    total = module.get_device_properties(module.current_device()).total_memory
    return {"device_memory": int(total), "ranks_per_node": local_processes(int(module.device_count()))}


def device_facts(backend: Any) -> dict[str, Any]:
    """The planner's facts about the devices ``backend`` drives (keys of :data:`FACT_KEYS`).

    Every backend shipped with LoongForge answers itself through ``planner_facts() -> dict`` (memory, ranks
    per node, achieved throughput, link speeds and a name saying where they came from). A backend without the
    method gets :func:`generic_facts`. Keys outside :data:`FACT_KEYS` are an error naming the backend, so a
    misspelt fact fails here instead of silently falling back to a default.
    """
    own = getattr(backend, "planner_facts", None)
    facts = dict(own()) if callable(own) else generic_facts(backend)
    unknown = sorted(set(facts) - FACT_KEYS)
    if unknown:
        raise ConfigError(f"device '{getattr(backend, 'name', backend)}': planner_facts() returned unknown "
                          f"key(s) {', '.join(unknown)}; known: {', '.join(sorted(FACT_KEYS))}")
    return facts


def generic_facts(backend: Any) -> dict[str, Any]:
    """What a third-party backend without ``planner_facts`` gets.

    A ``device_type == "cpu"`` backend: the host's facts (:func:`loongforge.devices.cpu.host_facts`). A
    backend with a ``torch.cuda``-style ``device_module()``: its current device's memory and device count with
    the :data:`UNKNOWN_ACCELERATOR` speeds. Anything else: only its name, so the device memory must come from
    ``parallel.planner.device_memory`` / ``--device-memory``.
    """
    name = getattr(backend, "name", "") or type(backend).__name__
    if getattr(backend, "device_type", "") == "cpu":
        from loongforge.devices.cpu import host_facts

        return {**host_facts(), "name": name}
    device_module = getattr(backend, "device_module", None)
    if not callable(device_module):
        return {"name": name}
    return {**module_device_facts(device_module()), **UNKNOWN_ACCELERATOR, "name": unknown_device_name(name)}
