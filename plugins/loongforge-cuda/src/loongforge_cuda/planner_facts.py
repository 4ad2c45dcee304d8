"""Throughput and link figures of NVIDIA GPUs for the parallel planner -- a table and pure functions.

The planner (``loongforge plan``, ``parallel: auto``) ranks layouts by predicted step time, which needs the
achieved matmul throughput of one GPU and the per-GPU bandwidth of collectives inside and across nodes.
:meth:`loongforge_cuda.backend.CUDABackend.planner_facts` reads the current GPU's name, compute capability
and memory from ``torch.cuda`` and looks the speeds up here; keeping the table free of CUDA calls lets every
row be tested on a CPU machine.

Where the numbers come from:

- Peak dense BF16 tensor-core throughput from NVIDIA's product datasheets (A100, H100, H200, L40S, A10, L4
  Tensor Core GPU datasheets). The datasheets quote tensor-core rates "with sparsity"; the dense rate used
  here is half of that (e.g. H100 SXM 1,979 -> 989 TFLOP/s).
- Achieved throughput = peak x :data:`ACHIEVED_FRACTION`. The planner's time model counts matmul FLOPs and
  adds communication, pipeline bubbles and narrow-matmul inefficiency itself, so this fraction stands for
  what large GEMMs plus the unmodelled elementwise kernels reach: between the ~0.7 of peak large bf16
  GEMMs reach and the 0.35-0.45 model-FLOPs utilisation typical of whole megatron-core runs. It is a
  documented default, not a measurement; calibration (``benchmarks/planner_calibration.py``) or
  ``--device-tflops`` replace it.
- Intra-node bandwidth per direction: NVLink 4 of SXM H100/H200 is 900 GB/s bidirectional (450e9 B/s per
  direction), NVLink 3 of SXM A100 600 GB/s (300e9). Cards without NVLink use their PCIe slot: Gen5 x16
  128 GB/s bidirectional (64e9), Gen4 x16 64 GB/s (32e9). PCIe H100/A100 NVLink bridges join pairs of cards
  only, so the slot is what a node-wide collective sees.
- Inter-node bandwidth per GPU from NVIDIA's reference systems: DGX H100/H200 give each GPU one 400 Gb/s
  ConnectX-7 port (50e9 B/s), DGX A100 one 200 Gb/s ConnectX-6 port (25e9). PCIe cards have no reference
  system; they get the conservative 100 Gb/s of :data:`loongforge.planner.hardware.UNKNOWN_ACCELERATOR`.
- Latency: 20 us per collective, the order of NCCL's small-message all-reduce time within a node (the
  planner's GPU default).

A GPU matches a row by its ``torch.cuda`` name *and* compute capability; anything else (a newer or rarer
model, a renamed part) gets :data:`~loongforge.planner.hardware.UNKNOWN_ACCELERATOR` and a name that says so.
The figures are for bf16 training; for fp32 (TF32 is half the bf16 rate) pass ``--device-tflops``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loongforge.planner.hardware import UNKNOWN_ACCELERATOR, unknown_device_name

#: Share of the datasheet peak the planner assumes a well-tuned run achieves on large matmuls (see above).
ACHIEVED_FRACTION = 0.5

NVLINK4 = 450e9  #: B/s per direction, SXM5 H100/H200 (900 GB/s bidirectional)
NVLINK3 = 300e9  #: B/s per direction, SXM4 A100 (600 GB/s bidirectional)
PCIE5_X16 = 64e9  #: B/s per direction (128 GB/s bidirectional)
PCIE4_X16 = 32e9  #: B/s per direction (64 GB/s bidirectional)
NIC_400G = 50e9  #: B/s, one 400 Gb/s port per GPU (DGX H100/H200)
NIC_200G = 25e9  #: B/s, one 200 Gb/s port per GPU (DGX A100)
NO_REFERENCE_NIC = UNKNOWN_ACCELERATOR["inter_node_bandwidth"]
LATENCY = 20e-6  #: s per collective


@dataclass(frozen=True)
class GPUFigures:
    """One GPU model: how to recognise it and its datasheet figures."""

    label: str
    #: Regular expression searched in ``torch.cuda.get_device_properties().name``.
    pattern: str
    capability: tuple[int, int]
    peak_bf16_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    def matches(self, name: str, capability: tuple[int, int]) -> bool:
        return tuple(capability) == self.capability and re.search(self.pattern, name) is not None


#: Most specific rows first: the PCIe H100 before the SXM one, the SXM A100 before the PCIe one.
#: ``\b`` keeps ``A10`` from matching ``A100``/``A10G``, ``L4`` from ``L40S`` and ``H200`` from ``GH200``;
#: the NVL variants (H100 NVL, H200 NVL) have other clocks and bridges and are left out on purpose.
GPUS: tuple[GPUFigures, ...] = (
    GPUFigures("H100 PCIe", r"\bH100\b.*\bPCIe\b", (9, 0), 756e12, PCIE5_X16, NO_REFERENCE_NIC),
    GPUFigures("H100 SXM", r"\bH100\b.*\b(SXM|HBM3)", (9, 0), 989e12, NVLINK4, NIC_400G),
    GPUFigures("H200 SXM", r"\bH200\b(?!.*\bNVL\b)", (9, 0), 989e12, NVLINK4, NIC_400G),
    GPUFigures("A100 SXM", r"\bA100\b.*\bSXM", (8, 0), 312e12, NVLINK3, NIC_200G),
    GPUFigures("A100 PCIe", r"\bA100\b(?!.*\bSXM)", (8, 0), 312e12, PCIE4_X16, NO_REFERENCE_NIC),
    GPUFigures("L40S", r"\bL40S\b", (8, 9), 362e12, PCIE4_X16, NO_REFERENCE_NIC),
    GPUFigures("L4", r"\bL4\b", (8, 9), 121e12, PCIE4_X16, NO_REFERENCE_NIC),
    GPUFigures("A10", r"\bA10\b", (8, 6), 125e12, PCIE4_X16, NO_REFERENCE_NIC),
)


def lookup(name: str, capability: tuple[int, int]) -> GPUFigures | None:
    """The row for a GPU called ``name`` with ``capability``, or ``None`` when the table does not know it."""
    return next((gpu for gpu in GPUS if gpu.matches(name, capability)), None)


def dense_peak(name: str, capability: tuple[int, int], precision: str) -> float | None:
    """The datasheet's dense tensor-core peak (FLOP/s) of one GPU model for ``precision``: the bf16 figure for bf16
    and fp16 (the same rate on every row of the table), and for fp8 too -- the usual MFU convention, since attention
    and the layers outside the FP8 recipe still run in bf16; ``None`` for fp32, whose rate depends on whether torch
    lets matmuls use TF32, and for a GPU the table does not know."""
    gpu = lookup(name, capability)
    return gpu.peak_bf16_flops if gpu is not None and precision in ("bf16", "fp16", "fp8") else None


def gpu_speeds(name: str, capability: tuple[int, int]) -> dict[str, Any]:
    """Achieved throughput, link bandwidths, latency and a descriptive name for one GPU model."""
    gpu = lookup(name, capability)
    if gpu is None:
        return {**UNKNOWN_ACCELERATOR, "name": unknown_device_name(f"{name} (sm{capability[0]}{capability[1]})")}
    return {"device_flops": gpu.peak_bf16_flops * ACHIEVED_FRACTION, "intra_node_bandwidth": gpu.intra_node_bandwidth,
            "inter_node_bandwidth": gpu.inter_node_bandwidth, "latency": LATENCY,
            "name": f"{name} ({gpu.label}, {ACHIEVED_FRACTION:.0%} of {gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16)"}
