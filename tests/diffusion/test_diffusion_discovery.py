"""loongforge-diffusion is discovered through its entry point and can be hidden."""

from __future__ import annotations

import pytest
from loongforge.testing.discovery import assert_discovered

pytestmark = pytest.mark.needs_plugins


def test_discovered_with_version():
    import loongforge_diffusion

    assert_discovered("diffusion", "loongforge-diffusion", loongforge_diffusion.__version__)
