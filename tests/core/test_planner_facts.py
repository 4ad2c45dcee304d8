"""Where the planner's hardware figures come from: the CPU backend's own facts, the generic answer for a
third-party backend without ``planner_facts``, and flags / ``parallel.planner`` winning over both."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from loongforge.cli import main
from loongforge.config.schema import PlannerConfig
from loongforge.devices.base import DeviceBackend, DeviceModuleBackend
from loongforge.devices.cpu import CPUBackend
from loongforge.errors import ConfigError
from loongforge.planner.auto import cluster_from_options
from loongforge.planner.hardware import CPU_DEFAULTS, FACT_KEYS, GIB, UNKNOWN_ACCELERATOR, device_facts

FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def host(monkeypatch):
    """A 64 GiB host with 2 usable cores, launched with 4 local processes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GIB))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_cpu_backend_answers_with_the_hosts_share(host):
    facts = device_facts(CPUBackend())
    assert facts == {"device_memory": 16 * GIB, "ranks_per_node": 4, "device_flops": 15e9,  # 2 cores / 4 ranks
                     "intra_node_bandwidth": CPU_DEFAULTS["intra_node_bandwidth"],
                     "inter_node_bandwidth": CPU_DEFAULTS["inter_node_bandwidth"],
                     "latency": CPU_DEFAULTS["latency"], "host_bandwidth": CPU_DEFAULTS["host_bandwidth"],
                     "name": "cpu"}


def test_one_process_per_core_keeps_the_full_cpu_figure(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    facts = CPUBackend().planner_facts()
    assert (facts["ranks_per_node"], facts["device_flops"]) == (1, CPU_DEFAULTS["device_flops"])
    assert facts["device_memory"] == psutil.virtual_memory().total


def test_flags_and_planner_options_win_over_the_backend(host):
    facts = device_facts(CPUBackend())
    options = PlannerConfig(device_memory="96GiB", ranks_per_node=8, device_tflops=123.0, intra_node_gbps=100.0,
                            inter_node_gbps=10.0)
    cluster = cluster_from_options(options, 16, facts)
    assert (cluster.num_devices, cluster.device_memory, cluster.ranks_per_node) == (16, 96 * GIB, 8)
    assert (cluster.device_flops, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth) == (123e12, 100e9, 10e9)
    assert (cluster.latency, cluster.name) == (CPU_DEFAULTS["latency"], "cpu")  # not given: the backend's
    untouched = cluster_from_options(PlannerConfig(), 4, facts)
    assert (untouched.device_memory, untouched.device_flops) == (16 * GIB, 15e9)


class ThirdPartyCPU(CPUBackend):
    """A plugin's CPU-type backend that does not override ``planner_facts``."""

    name = "acme-cpu"


class ThirdPartyAccelerator(DeviceModuleBackend):
    """A plugin's accelerator that does not override ``planner_facts``, driven through a FAKE ``torch.cuda``-style
    module."""

    name = "acme"
    device_type = "acme"
    probe = supports = spec_provider = None  # not exercised here

    def __init__(self, module):
        self.module = module

    def device_module(self):
        return self.module


def test_third_party_cpu_backend_gets_the_host_facts(host):
    facts = device_facts(ThirdPartyCPU())
    assert (facts["name"], facts["device_memory"], facts["device_flops"]) == ("acme-cpu", 16 * GIB, 15e9)


def test_third_party_accelerator_gets_its_memory_and_conservative_speeds(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    from fake_cuda import FakeCudaModule

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    facts = device_facts(ThirdPartyAccelerator(FakeCudaModule(device_count=4, total_memory=32 * GIB)))
    assert facts == {"device_memory": 32 * GIB, "ranks_per_node": 4, **UNKNOWN_ACCELERATOR,
                     "name": "acme (unknown: conservative figures)"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # fewer ranks than devices on this node
    assert device_facts(ThirdPartyAccelerator(FakeCudaModule(device_count=4)))["ranks_per_node"] == 2


class BareBackend(DeviceBackend):
    """A plugin's backend with no device module and no figures: the declared default knows only its name."""

    name = "bare"
    device_type = "bare"
    # not exercised here
    probe = supports = spec_provider = set_device = synchronize = manual_seed = None
    get_rng_state = set_rng_state = memory_stats = None


def test_backend_reporting_no_memory_needs_the_option():
    bare = BareBackend()
    assert device_facts(bare) == {"name": "bare"}
    with pytest.raises(ConfigError, match=r"\(bare\) does not report its memory; set parallel.planner.device_memory"):
        cluster_from_options(PlannerConfig(), 8, device_facts(bare))
    cluster = cluster_from_options(PlannerConfig(device_memory="24GiB"), 8, device_facts(bare))
    assert (cluster.device_memory, cluster.name) == (24 * GIB, "bare")


def test_misspelt_fact_is_an_error_naming_the_backend():
    typo = SimpleNamespace(name="typo", planner_facts=lambda: {"device_memory": GIB, "device_flop": 1e12})
    with pytest.raises(ConfigError, match="device 'typo': planner_facts\\(\\) returned unknown key\\(s\\) device_flop"):
        device_facts(typo)
    assert "device_flops" in FACT_KEYS and "num_devices" not in FACT_KEYS


def test_plan_command_without_memory_plans_for_this_machine(tmp_path, capsys, host, monkeypatch):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: llama-debug\ndata: {seq_length: 64}\ntraining: {global_batch_size: 8}\n")
    monkeypatch.setenv("LOONGFORGE_DEVICE", "cpu")
    assert main(["plan", str(config), "--devices", "4", "--kernels", "local", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "devices: cpu; 0.015 TFLOP/s achieved, links 2 GB/s in a node, 1 GB/s across, 200 us" in out
    assert "4 x 16 GiB (4 per node)" in out
    assert main(["plan", str(config), "--devices", "4", "--device-memory", "80GiB", "--top", "1"]) == 0
    assert "devices: gpu; 400 TFLOP/s achieved, links 450 GB/s in a node, 50 GB/s across" in capsys.readouterr().out
