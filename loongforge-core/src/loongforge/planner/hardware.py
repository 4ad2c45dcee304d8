"""What the planner needs to know about the machines: memory per device, devices per node, speeds.

These facts come from three places, most specific first: explicit flags / config keys, the device backend
(:func:`device_facts`: each backend's ``planner_facts()``, e.g. the CUDA plugin's table of datasheet figures
by GPU model), and defaults for a current datacenter GPU (NVLink within a node, InfiniBand between nodes).
Speeds are effective figures (what a well-tuned run achieves), which calibration
(:mod:`loongforge.planner.calibrate`) replaces with measured ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

# Device figures live with the devices (the lower layer); imported here for the planner and its callers.
from loongforge.devices.host import (  # noqa: F401
    CPU_DEFAULTS,
    UNKNOWN_ACCELERATOR,
    cpu_device_flops,
    local_processes,
    module_device_facts,
    unknown_device_name,
)
from loongforge.errors import ConfigError

if TYPE_CHECKING:
    from loongforge.devices.base import DeviceBackend

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
    collectives inside a node and across nodes; ``latency`` is a per-collective fixed cost (s);
    ``host_bandwidth`` is one device's copy rate to and from host memory (bytes/s each way), what activation offload
    moves over (PCIe Gen4 x16 achieves ~25 GB/s).
    """

    num_devices: int
    device_memory: int
    ranks_per_node: int = 8
    device_flops: float = 400e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    latency: float = 20e-6
    host_bandwidth: float = 25e9
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


#: The keys a backend's ``planner_facts()`` may return (every :class:`ClusterSpec` field but the count).
FACT_KEYS = frozenset(ClusterSpec.__dataclass_fields__) - {"num_devices"}


def device_facts(backend: DeviceBackend) -> dict[str, Any]:
    """The planner's facts about the devices ``backend`` drives: its declared
    :meth:`~loongforge.devices.base.DeviceBackend.planner_facts` (memory, ranks per node, achieved throughput,
    link speeds and a name saying where they came from). Keys outside :data:`FACT_KEYS` are an error naming the
    backend, so a misspelt fact fails here instead of silently falling back to a default.
    """
    facts = dict(backend.planner_facts())
    unknown = sorted(set(facts) - FACT_KEYS)
    if unknown:
        raise ConfigError(f"device '{backend.name}': planner_facts() returned unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(FACT_KEYS))}")
    return facts
