"""pytest fixtures for plugin authors.

``register_plugin`` puts a plugin into the process-wide host for one test and always removes it again,
so a test's plugin can never leak into the next test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loongforge.plugins import PluginHost, get_host, reset_host


@pytest.fixture
def plugin_host() -> Iterator[PluginHost]:
    """A freshly discovered plugin host, installed as the process-wide one for this test."""
    previous = get_host()
    host = PluginHost()
    reset_host(host)
    try:
        yield host
    finally:
        reset_host(previous)


@pytest.fixture
def register_plugin(plugin_host: PluginHost) -> Iterator[Callable[[Any, str], Any]]:
    """``register_plugin(obj, name)`` registers an in-process plugin for the duration of the test."""
    names: list[str] = []

    def register(plugin: Any, name: str) -> Any:
        plugin_host.register(plugin, name)
        names.append(name)
        return plugin

    yield register
    for name in names:
        plugin_host.unregister(name)
