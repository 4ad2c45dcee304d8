"""The CUDA backend's planner facts: datasheet figures by GPU name and compute capability, read through a
FAKE ``torch.cuda`` (tests/fakes/fake_cuda.py), and conservative figures for a GPU the table does not know."""

from __future__ import annotations

import pytest
from fake_cuda import FakeCudaModule
from fake_cuda_backend import FakeWiredCUDABackend
from loongforge.config.schema import PlannerConfig
from loongforge.planner.auto import cluster_from_options
from loongforge.planner.hardware import GIB, UNKNOWN_ACCELERATOR, device_facts
from loongforge_cuda.planner_facts import ACHIEVED_FRACTION, dense_peak, gpu_speeds, lookup

#: torch.cuda device names as the driver reports them -> (row, dense bf16 peak, intra-node, inter-node B/s).
KNOWN = [
    ("NVIDIA H100 80GB HBM3", (9, 0), "H100 SXM", 989e12, 450e9, 50e9),
    ("NVIDIA H100 PCIe", (9, 0), "H100 PCIe", 756e12, 64e9, 12.5e9),
    ("NVIDIA H200", (9, 0), "H200 SXM", 989e12, 450e9, 50e9),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "A100 SXM", 312e12, 300e9, 25e9),
    ("NVIDIA A100-PCIE-40GB", (8, 0), "A100 PCIe", 312e12, 32e9, 12.5e9),
    ("NVIDIA A100 80GB PCIe", (8, 0), "A100 PCIe", 312e12, 32e9, 12.5e9),
    ("NVIDIA L40S", (8, 9), "L40S", 362e12, 32e9, 12.5e9),
    ("NVIDIA L4", (8, 9), "L4", 121e12, 32e9, 12.5e9),
    ("NVIDIA A10", (8, 6), "A10", 125e12, 32e9, 12.5e9),
]


@pytest.mark.parametrize(("name", "capability", "label", "peak", "intra", "inter"), KNOWN)
def test_known_gpus_get_their_datasheet_figures(name, capability, label, peak, intra, inter):
    speeds = gpu_speeds(name, capability)
    assert lookup(name, capability).label == label
    assert speeds["device_flops"] == pytest.approx(peak * ACHIEVED_FRACTION)
    assert (speeds["intra_node_bandwidth"], speeds["inter_node_bandwidth"], speeds["latency"]) == (intra, inter, 20e-6)
    assert speeds["name"] == f"{name} ({label}, 50% of {peak / 1e12:.0f} TFLOP/s bf16)"


@pytest.mark.parametrize(("name", "capability"), [
    ("NVIDIA XYZ", (12, 0)),                # a GPU newer than the table
    ("NVIDIA A10G", (8, 6)),                # not the A10: other clocks
    ("NVIDIA GH200 480GB", (9, 0)),         # not an H200
    ("NVIDIA H200 NVL", (9, 0)),            # NVL variants are left out on purpose
    ("NVIDIA H100 NVL", (9, 0)),
    ("NVIDIA H100 80GB HBM3", (8, 0)),      # a known name with the wrong capability is not trusted
])
def test_unknown_gpus_get_conservative_figures_and_say_so(name, capability):
    speeds = gpu_speeds(name, capability)
    assert lookup(name, capability) is None
    assert {k: v for k, v in speeds.items() if k != "name"} == UNKNOWN_ACCELERATOR
    assert speeds["name"] == f"{name} (sm{capability[0]}{capability[1]}) (unknown: conservative figures)"


def test_backend_reads_the_current_gpu(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fake = FakeCudaModule(capability=(9, 0), device_count=8, name="NVIDIA H200", total_memory=141 * GIB)
    facts = device_facts(FakeWiredCUDABackend(fake))
    assert facts == {"device_memory": 141 * GIB, "ranks_per_node": 8, "device_flops": 494.5e12,
                     "intra_node_bandwidth": 450e9, "inter_node_bandwidth": 50e9, "latency": 20e-6,
                     "name": "NVIDIA H200 (H200 SXM, 50% of 989 TFLOP/s bf16)"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun started 4 ranks on this 8-GPU node
    assert device_facts(FakeWiredCUDABackend(fake))["ranks_per_node"] == 4


def test_flags_win_over_the_gpu_figures(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fake = FakeCudaModule(capability=(8, 0), device_count=8, name="NVIDIA A100-SXM4-80GB", total_memory=80 * GIB)
    options = PlannerConfig(device_memory="70GiB", device_tflops=180.0, inter_node_gbps=100.0)
    cluster = cluster_from_options(options, 32, device_facts(FakeWiredCUDABackend(fake)))
    assert (cluster.device_memory, cluster.device_flops, cluster.inter_node_bandwidth) == (70 * GIB, 180e12, 100e9)
    assert (cluster.ranks_per_node, cluster.intra_node_bandwidth) == (8, 300e9)  # not given: the GPU's


def test_probe_never_reads_the_properties():
    fake = FakeCudaModule(capability=(9, 0), device_count=1, name="NVIDIA H100 80GB HBM3")
    backend = FakeWiredCUDABackend(fake)
    backend.probe()
    assert not fake.initialized
    backend.planner_facts()
    assert fake.initialized  # reading device properties initialises CUDA, which is why only the trainer asks


@pytest.mark.parametrize(("name", "capability", "label", "peak", "intra", "inter"), KNOWN)
def test_mfu_peak_is_the_dense_tensor_core_figure(name, capability, label, peak, intra, inter):
    for precision in ("bf16", "fp16", "fp8"):  # fp8 runs are measured against the bf16 peak, by convention
        assert dense_peak(name, capability, precision) == peak
    assert dense_peak(name, capability, "fp32") is None  # TF32 or not is torch's switch: no one figure


def test_no_mfu_peak_for_a_gpu_the_table_does_not_know():
    assert dense_peak("NVIDIA XYZ", (12, 0), "bf16") is None
    assert dense_peak("NVIDIA H100 80GB HBM3", (8, 0), "bf16") is None


def test_backend_peak_reads_the_current_gpu():
    fake = FakeCudaModule(capability=(9, 0), device_count=8, name="NVIDIA H200", total_memory=141 * GIB)
    backend = FakeWiredCUDABackend(fake)
    assert backend.dense_peak_flops("bf16") == 989e12
    assert backend.dense_peak_flops("fp32") is None
