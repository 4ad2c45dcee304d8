"""The config sections plugins own -- ``task:``, ``device_options:``, ``optimizations.<name>:`` -- typed by the
dataclasses the plugins declare in slots of their contracts:

- ``task:`` by the model family's :attr:`~loongforge.models.family.ModelFamily.task_options`;
- ``device_options:`` by the device backend's :attr:`~loongforge.devices.base.DeviceBackend.options_type`;
- ``optimizations.<name>:`` by the optimization's :attr:`~loongforge.optimizations.Optimization.options_type`.

The config keeps these sections as the mappings the YAML gave (what is saved next to checkpoints); these functions
check them with :func:`~loongforge.config.sections.build_section`, so a plugin section fails exactly like one of
core's (declared ranges included, :func:`~loongforge.config.sections.ranged`); a ``task:`` section's floats must also
be finite (:func:`loongforge.config.numbers.check_finite`). The pre-flight check (:mod:`loongforge.train.preflight`)
calls them, and the plugins' tasks read their typed options through :func:`task_options`, so what ``check`` accepts
is what ``train`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongforge.config.numbers import check_finite
from loongforge.config.schema import LoongForgeConfig
from loongforge.config.sections import build_section
from loongforge.errors import ConfigError

if TYPE_CHECKING:
    from loongforge.devices.base import DeviceBackend
    from loongforge.models.family import ModelFamily


def task_options(family: ModelFamily, config: LoongForgeConfig) -> Any:
    """``config.task`` as an instance of ``family.task_options`` (its defaults when ``task:`` is empty), every
    declared range held and every float finite; ``None`` for a family without task options, which then must not be
    given any."""
    options_type = type(family).task_options
    if options_type is None:
        if config.task:
            shown = config.model.name or family.family_name
            raise ConfigError(f"{config.source}: unknown key 'task.{sorted(config.task)[0]}' (model '{shown}' takes "
                              "no task: section)")
        return None
    options = build_section(options_type, config.task, config.source, "task")
    check_finite(options, config.source, "task")
    return options


def device_options(backend: type[DeviceBackend] | DeviceBackend, config: LoongForgeConfig) -> dict[str, Any]:
    """The keys of ``config.device_options`` checked against ``backend.options_type``, with their typed values:
    the keyword arguments for ``backend.megatron_settings`` (only the keys given, so a backend can tell a set
    option from a default)."""
    options_type = backend.options_type
    given = config.device_options
    if options_type is None:
        if given:
            raise ConfigError(f"{config.source}: device_options: device '{backend.name}' takes no megatron options; "
                              f"got {', '.join(sorted(given))}")
        return {}
    typed = build_section(options_type, given, config.source, "device_options")
    return {key: getattr(typed, key) for key in given}
