"""Entry point of the ``xpu`` plugin.

Planned components (the hardware-plugins issue fills them): the Kunlunxin P800 device backend through
torch_xmlir, probed before CUDA, with XMLIR/BKCL environment defaults and the Megatron XPU patch hook.
"""

from __future__ import annotations

#: Shown by ``loongforge plugins`` until the plugin registers components of its own.
SUMMARY = "Kunlunxin P800 device backend via torch_xmlir (backend arrives in 0.2)"
