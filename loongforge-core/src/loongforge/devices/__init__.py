"""Device backends: the protocol hardware plugins implement, backend selection, and the built-in CPU backend.

Importing this package is cheap (no torch): ``loongforge plugins`` and backend probing must be instant. The
modules that need torch or megatron (``cpu_spec``, ``sdpa_attention``, ``norm``, ``megatron_cpu`` patches)
import them when used.
"""

from __future__ import annotations

from loongforge.devices.base import FEATURES, DeviceBackend
from loongforge.devices.selection import DeviceSelectionError, select_backend

__all__ = ["FEATURES", "DeviceBackend", "DeviceSelectionError", "select_backend"]
