"""Entry point of the ``embodied`` plugin.

Planned components (the embodied issue fills them): Pi0/Pi0.5 and GR00T-style policies, LeRobot dataset
readers, torch-native DDP/ZeRO-1/FSDP2/HSDP strategies, closed-loop evaluation.
"""

from __future__ import annotations

#: Shown by ``loongforge plugins`` until the plugin registers components of its own.
SUMMARY = "embodied VLA: Pi0/Pi0.5, GR00T, torch-native DDP/FSDP2 (components arrive in 0.2)"
