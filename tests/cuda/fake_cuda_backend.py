"""The CUDA backend wired to a FAKE ``torch.cuda`` (tests/fakes/fake_cuda.py) and a CUDA build of torch, so its
routing, probing and planner facts are tested on a CPU-only machine."""

from __future__ import annotations

from fake_cuda import FakeCudaModule
from loongforge.devices.torch_build import TorchBuild
from loongforge_cuda.backend import CUDABackend

#: The build the FAKE stands for: the probe asks the module only once the installed torch is a CUDA build.
FAKE_BUILD = TorchBuild(version="2.13.0+cu128", cuda="12.8", hip=None)


class FakeWiredCUDABackend(CUDABackend):
    """CUDABackend whose ``torch.cuda`` is a FAKE module and whose torch is a CUDA build (tests only)."""

    def __init__(self, fake: FakeCudaModule) -> None:
        self.fake = fake

    def device_module(self) -> FakeCudaModule:
        return self.fake

    def torch_build(self) -> TorchBuild:
        return FAKE_BUILD
