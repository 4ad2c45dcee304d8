"""Entry point of the ``embodied`` plugin: registers the policy flavors (Pi0, Pi0.5, Pi0-FAST, GR00T-style, the
world-action model on Wan's DiT) and the LeRobot dataset kind.

Torch-free at import and while registering (flavors are dataclasses; the reader loads numpy, pyarrow and PyAV when
a run asks for it; Meta-World and the policy server load only in their commands). The torch-native
DDP/ZeRO-1/FSDP2/HSDP strategies the policies train with live in core (``parallel.strategy``)."""

from __future__ import annotations

from loongforge import hookimpl

#: Shown by ``loongforge plugins``.
SUMMARY = (
    "embodied VLA: Pi0 / Pi0.5 / Pi0-FAST / GR00T-style policies, a Wan world-action model, LeRobot v2.1/v3.0 data, "
    "Meta-World closed loop")


@hookimpl
def loongforge_register_datasets(registry):
    registry.register("lerobot", "loongforge_embodied.data.kind:lerobot_dataset",
                      description="LeRobotDataset v2.1/v3.0 on local disk: parquet + H.264/AV1 mp4 (PyAV) or PNG")


@hookimpl
def loongforge_register_models(registry):
    from loongforge_embodied.policies import fast_flavors, flavors, gr00t_flavors, pi05_gemma_flavors, wam_flavors

    for name, flavor in {**flavors.FLAVORS, **fast_flavors.FLAVORS, **gr00t_flavors.FLAVORS,
                         **pi05_gemma_flavors.FLAVORS, **wam_flavors.FLAVORS}.items():
        registry.register(name, flavor, description=flavor.describe())


@hookimpl
def loongforge_register_commands(commands):
    from loongforge_embodied.commands import register_commands

    register_commands(commands)


@hookimpl
def loongforge_register_certification_recipes(registry):
    registry.register("embodied", "loongforge_embodied.certification:POLICY",
                      description="vision-language-action policy (pi05-tiny) with flow matching")
