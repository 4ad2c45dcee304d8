"""Kunlun P800 contract tests against FAKE torch_xmlir / xpu_plugin modules and fake /dev/xpuN nodes.

These check detection, precedence over CUDA, environment defaults, the megatron patch gate and capability
answers -- the logic loongforge-xpu owns. They claim nothing about numerics or speed on a P800: the fakes
(tests/fakes, each name citing its public source) run no kernels.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_cuda import FakeCudaModule
from loongforge.devices.base import FEATURES, DeviceModuleBackend
from loongforge.devices.selection import select_backend
from loongforge.registry import Registry
from loongforge.testing.device_suite import DeviceBackendSuite
from loongforge_xpu import megatron_plugin
from loongforge_xpu.backend import XPUBackend
from loongforge_xpu.environment import DEFAULT_ENV

FAKES = Path(__file__).resolve().parents[1] / "fakes"
#: On a P800 host the suite runs on the real backend; elsewhere on the FAKE Kunlun host below.
REAL_XPU = XPUBackend().probe()[0]


class FakeHostXPUBackend(XPUBackend):
    """XPUBackend looking at fake device nodes, with torch.cuda replaced by a FAKE module (tests only)."""

    def __init__(self, nodes_dir: Path, fake: FakeCudaModule) -> None:
        self.device_node_glob = str(nodes_dir / "xpu[0-9]*")
        self.fake = fake

    def device_module(self) -> FakeCudaModule:
        import torch_xmlir  # noqa: F401 - the FAKE one; the real backend imports it before using torch.cuda

        return self.fake


def make_nodes(root: Path, count: int) -> Path:
    """Empty files named like the Kunlun driver's device nodes (plus the control node, which is not an XPU)."""
    root.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        (root / f"xpu{index}").touch()
    (root / "xpuctrl").touch()
    return root


def _forget(*prefixes: str) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in prefixes]:
        del sys.modules[name]


@pytest.fixture
def fake_torch_xmlir(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES / "kunlun_torch"))
    yield
    _forget("torch_xmlir")


@pytest.fixture
def fake_xpu_plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES / "kunlun_megatron"))
    import xpu_plugin

    xpu_plugin.CALLS.clear()
    yield xpu_plugin
    _forget("xpu_plugin")


@pytest.fixture(autouse=True)
def fresh_patch_state(monkeypatch):
    """Each test sees a process in which Kunlun's megatron patches have not been applied yet."""
    monkeypatch.setattr(megatron_plugin, "_outcome", None)


class TestXPUBackendConformance(DeviceBackendSuite):
    backend_class = XPUBackend
    registry_name = "xpu"
    probe_must_not_import = ("torch_xmlir", "xpu_plugin")
    #: Without the hardware the backend is wired to a FAKE module, so its training step runs on CPU (see the suite).
    train_on_device = REAL_XPU

    @pytest.fixture(autouse=True)
    def kunlun_host(self, tmp_path, monkeypatch):
        if not REAL_XPU:
            self.nodes = make_nodes(tmp_path / "dev", 2)
            monkeypatch.syspath_prepend(str(FAKES / "kunlun_torch"))
        yield
        _forget("torch_xmlir")

    @functools.cached_property
    def fake(self) -> FakeCudaModule:
        return FakeCudaModule(device_count=2)

    def make_backend(self) -> XPUBackend:
        return XPUBackend() if REAL_XPU else FakeHostXPUBackend(self.nodes, self.fake)

    def draw_random(self, backend, n):
        return super().draw_random(backend, n) if REAL_XPU else self.fake.rand(n)

    def device_initialized(self) -> bool:
        import torch

        return torch.cuda.is_initialized() if REAL_XPU else self.fake.initialized


def test_identity_is_kunluns_cuda_compatible_torch():
    backend = XPUBackend()
    assert (backend.name, backend.device_type, backend.dist_backend) == ("xpu", "cuda", "nccl")
    assert backend.priority == 300  # above loongforge-cuda's 200


def test_detection_needs_torch_xmlir_and_device_nodes(tmp_path, fake_torch_xmlir):
    empty = FakeHostXPUBackend(tmp_path / "none", FakeCudaModule())
    pattern = f"{tmp_path}/none/xpu[0-9]*"
    assert empty.probe() == (False, f"torch_xmlir is installed but no Kunlun device node matches {pattern}; check "
                                    "the driver (xpu-smi), or start the container with the /dev/xpu* devices")
    host = FakeHostXPUBackend(make_nodes(tmp_path / "dev", 3), FakeCudaModule())
    assert host.probe() == (True, "3 Kunlun XPU(s) (xpu0, xpu1, xpu2) via torch_xmlir")
    assert "torch_xmlir" not in sys.modules, "probing must not import torch_xmlir"


def test_without_torch_xmlir_the_backend_is_unavailable(tmp_path):
    assert FakeHostXPUBackend(make_nodes(tmp_path, 8), FakeCudaModule()).probe() == (
        False, "not present: torch_xmlir (Kunlun XPyTorch) is not importable; on a Kunlun host, install Kunlun's "
               "XPyTorch wheel into this environment")


class CudaLike(DeviceModuleBackend):
    """Stands in for loongforge-cuda (not installed in this plugin's test session): trusts torch.cuda."""

    name, priority, device_type, dist_backend = "cuda", 200, "cuda", "nccl"
    fake = FakeCudaModule()  # torch_xmlir makes torch.cuda.is_available() true on a P800 host

    def device_module(self):
        return self.fake

    def probe(self):
        return self.fake.is_available(), "torch.cuda.is_available()"

    supports = XPUBackend.supports
    spec_provider = XPUBackend.spec_provider


def test_auto_picks_kunlun_over_cuda_when_torch_cuda_also_answers(tmp_path, fake_torch_xmlir):
    from loongforge.devices.cpu import CPUBackend

    nodes = make_nodes(tmp_path / "dev", 8)
    registry = Registry("device")
    registry.register("cpu", CPUBackend)
    registry.register("cuda", CudaLike)
    registry.register("xpu", lambda: FakeHostXPUBackend(nodes, CudaLike.fake))
    backend, reason = select_backend("auto", registry)
    assert backend.name == "xpu" and "priority (300)" in reason and "cuda (priority 200)" in reason
    for node in nodes.glob("xpu*"):  # no Kunlun card: CUDA wins again
        node.unlink()
    assert select_backend("auto", registry)[0].name == "cuda"


def test_environment_defaults_never_override_the_user(monkeypatch):
    for name in DEFAULT_ENV:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("BKCL_FORCE_L3_RDMA", "1")
    monkeypatch.setenv("XMLIR_MEGATRON_CORE_XPU_PLUGIN", "0")
    XPUBackend().configure_env()
    assert os.environ["BKCL_FORCE_L3_RDMA"] == "1"
    assert os.environ["XMLIR_MEGATRON_CORE_XPU_PLUGIN"] == "0"
    user_set = ("BKCL_FORCE_L3_RDMA", "XMLIR_MEGATRON_CORE_XPU_PLUGIN")
    untouched = {k: os.environ[k] for k in DEFAULT_ENV if k not in user_set}
    assert untouched == {k: v for k, (v, _) in DEFAULT_ENV.items() if k in untouched}
    assert all(k.startswith(("XMLIR_", "BKCL_", "CUDA_DEVICE_MAX_CONNECTIONS")) for k in DEFAULT_ENV)


@pytest.mark.parametrize(("value", "enabled"), [
    ("true", True), ("1", True), ("True", True),
    ("TRUE", False), ("yes", False), ("on", False), ("0", False), ("false", False), ("", False), (" 1", False),
    (None, False),
])
def test_patch_gate_accepts_exactly_the_documented_values(value, enabled, monkeypatch, fake_xpu_plugin):
    if value is None:
        monkeypatch.delenv(megatron_plugin.GATE, raising=False)
    else:
        monkeypatch.setenv(megatron_plugin.GATE, value)
    assert megatron_plugin.gate_enabled() is enabled
    XPUBackend().apply_patches()
    assert fake_xpu_plugin.CALLS == (["init_megatron_core_xpu_plugin"] if enabled else [])


def test_patches_are_applied_once_per_process(monkeypatch, fake_xpu_plugin):
    monkeypatch.setenv(megatron_plugin.GATE, "1")
    backend = XPUBackend()
    backend.apply_patches()
    backend.apply_patches()
    XPUBackend().apply_patches()
    assert fake_xpu_plugin.CALLS == ["init_megatron_core_xpu_plugin"]
    assert megatron_plugin.apply_megatron_xpu_plugin() == "applied"


def test_missing_patch_module_warns_instead_of_crashing(monkeypatch):
    monkeypatch.setenv(megatron_plugin.GATE, "true")
    with pytest.warns(UserWarning, match="'xpu_plugin' module is not installed; training without"):
        XPUBackend().apply_patches()
    assert megatron_plugin.apply_megatron_xpu_plugin() == "missing"


def test_capabilities_no_fp8_no_transformer_engine():
    assert {f: XPUBackend().supports(f) for f in FEATURES} == {
        "bf16": True, "fp16": True, "fp8": False, "te": False, "flash_attn": False, "cuda_graphs": False,
        "sequence_parallel": True, "streams": False,
    }
    with pytest.raises(ValueError, match="does not support precision 'fp8'"):
        XPUBackend().megatron_settings("fp8")
    assert XPUBackend().megatron_settings("bf16").params_dtype == "bf16"


def test_doctor_rows_describe_the_kunlun_stack(tmp_path, fake_torch_xmlir, monkeypatch):
    monkeypatch.setenv("BKCL_SOCKET_IFNAME", "eth0")
    rows = dict(FakeHostXPUBackend(make_nodes(tmp_path, 2), FakeCudaModule()).doctor_rows())
    assert rows["torch_xmlir"].endswith(os.path.join("torch_xmlir", "__init__.py"))
    assert rows["device nodes"] == f"{tmp_path}/xpu0, {tmp_path}/xpu1"
    assert rows["BKCL_SOCKET_IFNAME"] == "eth0"
    assert "torch_xmlir" not in sys.modules


def test_loongforge_doctor_prints_a_kunlun_section():
    # on a host without XPUs the section is printed on request only (tests/core/test_cli_doctor.py)
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "doctor", "--all"], capture_output=True, text=True,
                            check=True, env={**os.environ, "COLUMNS": "200"})
    section = result.stdout.split("xpu backend (loongforge-xpu)", 1)
    assert len(section) == 2, result.stdout
    for item in ("torch_xmlir", "device nodes", "xpu-smi", "xpu_plugin", "megatron patches", "BKCL_ENABLE_XDR"):
        assert item in section[1], item


def test_the_layer_spec_builds_multi_latent_attention_and_keeps_megatrons_attention_elsewhere():
    """Kunlun's layers are megatron's local ones (what its xpu_plugin patches); MLA, which asks its core attention for
    query/key heads wider than value heads, must build too and compute what the CPU's layers compute."""
    import torch
    from loongforge.devices.cpu import CPUBackend
    from loongforge.interop.sharding import gather_full_state, load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.deepseek.attention import DeepSeekMLA
    from loongforge.models.deepseek.flavors import FLAVORS as DEEPSEEK
    from loongforge.models.llama import FLAVORS as LLAMA
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class KunlunLayersOnTheCPU(CPUBackend):
        def spec_provider(self):
            return XPUBackend().spec_provider()

    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    with standalone_world() as cpu:
        reference = build_standalone(DEEPSEEK["deepseek-v3-tiny"], cpu)
        weights = gather_full_state([reference])
        with torch.no_grad():
            expected = reference.eval()(tokens, positions, None)
    with standalone_world(KunlunLayersOnTheCPU()) as kunlun:
        model = build_standalone(DEEPSEEK["deepseek-v3-tiny"], kunlun)
        load_full_state([model], weights)
        attention = [m for m in model.modules() if isinstance(m, DeepSeekMLA)]
        assert attention and all(type(m.core_attention).__name__ == "SDPAttention" for m in attention)
        with torch.no_grad():
            assert (model.eval()(tokens, positions, None) - expected).abs().max().item() <= 1e-5
        llama = build_standalone(LLAMA["llama-debug"], kunlun)
        assert any(isinstance(m, DotProductAttention) for m in llama.modules())
