"""loongforge-cuda is discovered through its entry point and can be hidden."""

from __future__ import annotations

import pytest
from loongforge.testing.discovery import assert_discovered

pytestmark = pytest.mark.needs_plugins


def test_discovered_with_version():
    import loongforge_cuda

    assert_discovered("cuda", "loongforge-cuda", loongforge_cuda.__version__)


def test_backend_registered_and_probe_is_honest():
    from loongforge.plugins import PluginHost

    entry = PluginHost().registry("device").entry("gpu")
    assert entry.name == "cuda" and entry.provider == "loongforge-cuda"
    backend = entry.load()()
    available, reason = backend.probe()
    import torch

    assert available == torch.cuda.is_available()
    assert reason
    with pytest.raises(ValueError, match="unknown device feature"):
        backend.supports("warp-drive")
