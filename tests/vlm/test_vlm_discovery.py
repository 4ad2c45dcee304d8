"""loongforge-vlm is discovered through its entry point and can be hidden."""

from __future__ import annotations

import pytest
from loongforge.testing.discovery import assert_discovered

pytestmark = pytest.mark.needs_plugins


def test_discovered_with_version():
    import loongforge_vlm

    assert_discovered("vlm", "loongforge-vlm", loongforge_vlm.__version__)
