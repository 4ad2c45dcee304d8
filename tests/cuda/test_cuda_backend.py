"""loongforge-cuda passes the device conformance suite, on a GPU or -- without one -- through a FAKE torch.cuda.

On a machine whose probe finds CUDA the suite runs on the real backend; elsewhere the same checks run on the
backend wired to :class:`fake_cuda.FakeCudaModule`, which tests the routing through the ``torch.cuda`` API,
not GPU numerics.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import torch
from fake_cuda import FakeCudaModule
from fake_cuda_backend import FakeWiredCUDABackend
from loongforge.testing.device_suite import DeviceBackendSuite
from loongforge_cuda.backend import CUDABackend

#: The probe's answer on this machine decides whether the suite touches a real GPU or the FAKE one.
REAL_CUDA = CUDABackend().probe()[0]



class TestCUDABackendConformance(DeviceBackendSuite):
    backend_class = CUDABackend
    registry_name = "cuda"
    probe_must_not_import = ("transformer_engine", "flash_attn")
    #: Without the hardware the backend is wired to a FAKE module, so its training step runs on CPU (see the suite).
    train_on_device = REAL_CUDA

    @functools.cached_property
    def fake(self) -> FakeCudaModule:
        return FakeCudaModule(capability=(9, 0))

    def make_backend(self) -> CUDABackend:
        return CUDABackend() if REAL_CUDA else FakeWiredCUDABackend(self.fake)

    def draw_random(self, backend, n):
        return super().draw_random(backend, n) if REAL_CUDA else self.fake.rand(n)

    def device_initialized(self) -> bool:
        return torch.cuda.is_initialized() if REAL_CUDA else self.fake.initialized


def test_probe_reports_this_machine_honestly():
    available, reason = CUDABackend().probe()
    assert available == torch.cuda.is_available()
    if available:
        assert "CUDA device(s)" in reason
    else:
        assert "without CUDA" in reason or "no CUDA device visible" in reason
        assert not any(CUDABackend().supports(f) for f in ("bf16", "fp8", "te", "flash_attn"))


def test_device_ops_route_through_torch_cuda_api():
    fake = FakeCudaModule(capability=(8, 0), device_count=2)
    backend = FakeWiredCUDABackend(fake)
    assert backend.probe() == (True, "2 CUDA device(s), CUDA 12.8")
    assert not fake.initialized, "probing must not initialise CUDA"
    backend.set_device(1)
    backend.synchronize()
    assert (fake.current_device_index, fake.synchronize_calls) == (1, 1)
    assert backend.memory_stats() == {"allocated": 1024, "peak_allocated": 4096, "reserved": 8192}
    with backend.profiler_range("step"):
        pass
    assert fake.nvtx.ranges == ["step"]
    assert backend.supports("bf16") and not backend.supports("fp8")  # sm80 without Transformer Engine


def test_requesting_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'out'}}}
        model: llama-debug
        device: cuda
        training: {{steps: 1}}
    """))
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config)],
                            capture_output=True, text=True)
    if REAL_CUDA:
        assert result.returncode == 0, result.stderr[-2000:]
    else:
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "device 'cuda' (device in" in errors[0] and "is not available" in errors[0], errors
