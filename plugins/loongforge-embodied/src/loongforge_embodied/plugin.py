"""Entry point of the ``embodied`` plugin: registers the Pi0.5-style policy flavors and the LeRobot dataset kind.

Torch-free at import and while registering (flavors are dataclasses; the reader loads numpy, pyarrow and PyAV when
a run asks for it). Still to come (see CHANGELOG.md): Pi0 and GR00T-style policies, closed-loop Meta-World
evaluation, LeRobot/OpenPI weight conversion. The torch-native DDP/ZeRO-1/FSDP2/HSDP strategies the policies train
with live in core (``parallel.strategy``).
"""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = "embodied VLA: Pi0.5-style flow-matching policy, LeRobot v2.1/v3.0 datasets"


@hookimpl
def loongforge_register_datasets(registry):
    registry.register("lerobot", "loongforge_embodied.data.kind:lerobot_dataset",
                      description="LeRobotDataset v2.1/v3.0 on local disk: parquet + H.264/AV1 mp4 (PyAV) or PNG")


@hookimpl
def loongforge_register_models(registry):
    from loongforge_embodied.policies import flavors

    for name, flavor in flavors.FLAVORS.items():
        registry.register(name, flavor, description=flavors.describe(flavor))
