"""FAKE xpu_plugin -- NOT Kunlun's package.

Mirrors the one public entry point the reference LoongForge repository calls (baidu-baige/LoongForge,
``loongforge/utils/xpu_init.py``: ``from xpu_plugin import init_megatron_core_xpu_plugin``). It patches
nothing; it counts calls so tests can check the gate and idempotence.
"""

CALLS: list[str] = []


def init_megatron_core_xpu_plugin() -> None:
    """FAKE: record the call."""
    CALLS.append("init_megatron_core_xpu_plugin")
