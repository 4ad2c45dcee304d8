"""What the parallel planner is told about a Kunlunxin XPU: measured memory, conservative speeds.

Memory per device and devices per node are read from the device through torch_xmlir's CUDA-compatible
``torch.cuda`` API (``get_device_properties(current_device()).total_memory``, ``device_count()``), as for any
``torch.cuda``-style backend. Throughput and link bandwidths are *not* claimed: Kunlunxin publishes no
datasheet figures for the P800's dense bf16 rate, its XPU interconnect or BKCL collective bandwidth that this
project can cite, so the planner uses core's deliberately low
:data:`~loongforge.planner.hardware.UNKNOWN_ACCELERATOR` figures and the device's name says so. On a P800
cluster, measure and pass them (``parallel.planner.device_tflops`` / ``intra_node_gbps`` / ``inter_node_gbps``,
or a calibration file from ``benchmarks/planner_calibration.py``); they then win over these.
"""

from __future__ import annotations

from typing import Any

from loongforge.planner.hardware import UNKNOWN_ACCELERATOR, module_device_facts, unknown_device_name


def xpu_facts(module: Any) -> dict[str, Any]:
    """Planner facts of the current XPU behind ``module`` (torch.cuda after ``import torch_xmlir``)."""
    properties = module.get_device_properties(module.current_device())
    name = f"Kunlunxin {getattr(properties, 'name', '') or 'XPU'}"
    return {**module_device_facts(module), **UNKNOWN_ACCELERATOR, "name": unknown_device_name(name)}
