"""Planner figures the device backends report (a CPU host's ranks, a ``torch.cuda``-style device, an accelerator
nobody has measured), kept with the devices (the lower layer) so that the backends' ``planner_facts`` and the
planner (:mod:`loongforge.planner.hardware`, which re-exports these) share them without the devices importing
the planner."""

from __future__ import annotations

import os
from typing import Any

#: A CPU "device": a process on a shared host; memory bandwidth stands in for the link (gloo over shared
#: memory/TCP loopback), and the throughput figure is what fp32 matmuls achieve per process with a core to
#: itself (:func:`cpu_device_flops` shares it out when processes outnumber cores).
CPU_DEFAULTS = {"device_flops": 30e9, "intra_node_bandwidth": 2e9, "inter_node_bandwidth": 1e9, "latency": 2e-4,
                "host_bandwidth": 4e9}


def cpu_device_flops(processes: int, cores: int) -> float:
    """Per-process throughput of ``processes`` single-threaded ranks sharing ``cores`` cores."""
    return CPU_DEFAULTS["device_flops"] * min(1.0, cores / max(1, processes))


def local_processes(default: int) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else ``default``."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return max(1, int(value)) if value else default


#: Speeds for an accelerator nobody has described to the planner -- an unknown GPU, a Kunlun XPU (no
#: published figures we can cite) or a third-party ``DeviceModuleBackend`` without figures of its own.
#: Deliberately low, so
#: an unknown device is never planned as faster than it is: 50 TFLOP/s achieved (half of a 100 TFLOP/s
#: peak, below every bf16 datacenter GPU of the last generations), PCIe Gen4 x16 inside a node (32 GB/s
#: per direction), one 100 Gb/s port per device across nodes, 50 us per collective.
UNKNOWN_ACCELERATOR = {"device_flops": 50e12, "intra_node_bandwidth": 32e9, "inter_node_bandwidth": 12.5e9,
                       "latency": 50e-6}


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
