"""Entry point of the ``embodied`` plugin: registers the LeRobot dataset kind.

Torch-free at import and while registering (the reader loads numpy, pyarrow and PyAV when a run asks for it).
Still to come (see CHANGELOG.md): Pi0/Pi0.5 and GR00T-style policies, closed-loop Meta-World evaluation,
LeRobot/OpenPI weight conversion. The torch-native DDP/ZeRO-1/FSDP2/HSDP strategies these policies train with
live in core (``parallel.strategy``).
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "embodied VLA: LeRobot v2.1/v3.0 datasets (policies arrive next)"


@hookimpl
def loongforge_register_datasets(registry):
    registry.register("lerobot", "loongforge_embodied.data.kind:lerobot_dataset",
                      description="LeRobotDataset v2.1/v3.0 on local disk: parquet + H.264/AV1 mp4 (PyAV) or PNG")
