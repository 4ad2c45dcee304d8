"""loongforge-balance is discovered through its entry point."""

from __future__ import annotations

import pytest
from loongforge.testing.discovery import assert_discovered

pytestmark = pytest.mark.needs_plugins


def test_discovered_with_version():
    import loongforge_balance

    assert_discovered("balance", "loongforge-balance", loongforge_balance.__version__)
