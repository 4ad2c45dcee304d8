"""The Kunlun XPU backend's planner facts: memory and device count read through torch_xmlir's torch.cuda API
(FAKE modules from tests/fakes), conservative speeds named as such, and flags winning over them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_cuda import FakeCudaModule
from loongforge.config.schema import PlannerConfig
from loongforge.planner.auto import cluster_from_options
from loongforge.planner.hardware import GIB, UNKNOWN_ACCELERATOR, device_facts
from loongforge_xpu.backend import XPUBackend

FAKES = Path(__file__).resolve().parents[1] / "fakes"


class FakeWiredXPUBackend(XPUBackend):
    """XPUBackend whose torch.cuda (after ``import torch_xmlir``) is a FAKE module (tests only)."""

    def __init__(self, fake: FakeCudaModule) -> None:
        self.fake = fake

    def device_module(self) -> FakeCudaModule:
        super().device_module()  # imports the FAKE torch_xmlir, as the real backend imports the real one
        return self.fake


@pytest.fixture
def fake_torch_xmlir(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.syspath_prepend(str(FAKES / "kunlun_torch"))
    yield
    sys.modules.pop("torch_xmlir", None)


def test_memory_and_count_are_measured_speeds_conservative(fake_torch_xmlir):
    fake = FakeCudaModule(device_count=8, name="P800", total_memory=96 * GIB)
    facts = device_facts(FakeWiredXPUBackend(fake))
    assert facts == {"device_memory": 96 * GIB, "ranks_per_node": 8, **UNKNOWN_ACCELERATOR,
                     "name": "Kunlunxin P800 (unknown: conservative figures)"}
    assert "torch_xmlir" in sys.modules


def test_local_world_size_and_flags_win(fake_torch_xmlir, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    facts = device_facts(FakeWiredXPUBackend(FakeCudaModule(device_count=8, name="P800", total_memory=96 * GIB)))
    assert facts["ranks_per_node"] == 4
    options = PlannerConfig(device_tflops=200.0, intra_node_gbps=100.0, inter_node_gbps=25.0)
    cluster = cluster_from_options(options, 16, facts)
    assert (cluster.device_flops, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth) == (200e12, 100e9, 25e9)
    assert (cluster.device_memory, cluster.latency) == (96 * GIB, UNKNOWN_ACCELERATOR["latency"])
