"""The plugin manager: discovers plugins, fills the registries, and calls lifecycle hooks.

Plugins are modules named by entry points in the ``loongforge`` group (``core`` is LoongForge's own parts,
registered through the same hooks). Core code never calls ``pm.hook.*`` directly: it goes through the
typed methods of :class:`PluginHost`, which keeps hook names and argument names checked in one place.

Environment controls:

* ``LOONGFORGE_DISABLE_PLUGINS=a,b`` — do not load these plugins (block list).
* ``LOONGFORGE_LOAD_PLUGINS=a,b`` — load only these plugins (allow list); ``core`` always loads.

A plugin that fails to import, or implements a hook that does not exist (a typo), raises
:class:`PluginLoadError` naming the plugin, its distribution and version, and how to disable it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from importlib_metadata import entry_points

from loongforge import hookspecs
from loongforge.errors import PluginLoadError
from loongforge.registry import REGISTRY_KINDS, Registry

ENTRY_POINT_GROUP = "loongforge"
PROJECT_NAME = "loongforge"
CORE_PLUGIN = "core"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: The collector hook that fills each registry kind.
_COLLECTORS = {
    "device": "loongforge_register_devices",
    "model": "loongforge_register_models",
    "strategy": "loongforge_register_parallel_strategies",
    "dataset": "loongforge_register_datasets",
    "tokenizer": "loongforge_register_tokenizers",
    "optimization": "loongforge_register_optimizations",
}


@dataclass
class PluginInfo:
    """What ``loongforge plugins`` shows about one loaded plugin."""

    name: str
    distribution: str
    version: str
    module: str
    #: One line on what the plugin is for (its ``SUMMARY`` attribute, else its docstring's first line).
    summary: str = ""
    #: registry kind -> names this plugin registered there.
    registered: dict[str, list[str]] = field(default_factory=dict)


def _env_list(var: str) -> set[str]:
    return {item.strip() for item in os.environ.get(var, "").split(",") if item.strip()}


class PluginHost:
    """A typed wrapper around pluggy's manager for the ``loongforge`` project."""

    def __init__(self, *, autoload: bool = True) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registries: dict[str, Registry] | None = None
        if autoload:
            self._load_entry_points()

    # -- discovery -------------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        blocked = _env_list("LOONGFORGE_DISABLE_PLUGINS")
        allowed = _env_list("LOONGFORGE_LOAD_PLUGINS")
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name != CORE_PLUGIN, e.name)):
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            if ep.name != CORE_PLUGIN and (ep.name in blocked or (allowed and ep.name not in allowed)):
                continue
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown distribution>"
            version = dist.version if dist is not None else "?"
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must name the plugin
                raise PluginLoadError(self._broken(ep.name, dist_name, version, f"failed to import: {exc!r}")) from exc
            self.register(module, ep.name, distribution=dist_name, version=version)

    @staticmethod
    def _broken(name: str, dist: str, version: str, what: str) -> str:
        if name == CORE_PLUGIN:
            return f"LoongForge's own plugin ({dist} {version}) {what}. This is a bug in {dist}: please report it"
        return (
            f"plugin '{name}' ({dist} {version}) {what}. Disable it with LOONGFORGE_DISABLE_PLUGINS={name} "
            f"or remove it with: pip uninstall {dist}"
        )

    def register(self, plugin: Any, name: str, *, distribution: str = "<in-process>", version: str = "") -> None:
        """Register ``plugin`` (a module or object with hook implementations) under ``name``.

        Used for entry-point plugins and, through :mod:`loongforge.testing`, for in-process plugins.
        Registries are rebuilt on next use so the new plugin's components appear.
        """
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginLoadError(self._broken(name, distribution, version, f"is invalid: {exc}")) from None
        module = getattr(plugin, "__name__", type(plugin).__name__)
        summary = getattr(plugin, "SUMMARY", None) or (plugin.__doc__ or "").strip().splitlines()[0:1]
        summary = summary if isinstance(summary, str) else "".join(summary)
        self.plugins[name] = PluginInfo(name, distribution, version, module, summary)
        self._registries = None

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` (a no-op when absent)."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.plugins.pop(name, None)
        self._registries = None

    # -- registries --------------------------------------------------------------------------------

    def registry(self, kind: str) -> Registry:
        """The filled registry of ``kind`` (one of :data:`loongforge.registry.REGISTRY_KINDS`)."""
        if self._registries is None:
            self._registries = self._collect()
        return self._registries[kind]

    def _collect(self) -> dict[str, Registry]:
        registries = {kind: Registry(kind) for kind in REGISTRY_KINDS}
        for info in self.plugins.values():
            info.registered = {}
        for kind, hook_name in _COLLECTORS.items():
            registry = registries[kind]
            # Call implementations one by one, in registration order, so each entry records its provider.
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                info = self.plugins.get(impl.plugin_name)
                registry.current_provider = info.distribution if info else impl.plugin_name
                before = set(registry.names())
                try:
                    impl.function(**{arg: registry for arg in impl.argnames})
                except PluginLoadError:
                    raise
                except Exception as exc:  # noqa: BLE001 - name the plugin whose registration broke
                    dist, ver = (info.distribution, info.version) if info else ("?", "?")
                    raise PluginLoadError(
                        self._broken(impl.plugin_name, dist, ver, f"failed in {hook_name}: {exc}")
                    ) from exc
                added = sorted(set(registry.names()) - before)
                if info is not None and added:
                    info.registered.setdefault(kind, []).extend(added)
            registry.current_provider = "<unknown>"
        return registries

    # -- lifecycle ---------------------------------------------------------------------------------

    def configure(self, config: Any) -> None:
        self.pm.hook.loongforge_configure(config=config)

    def modify_model(self, model: Any, config: Any) -> Any:
        """Chain ``loongforge_modify_model`` implementations; each may return a replacement."""
        for impl in self.pm.hook.loongforge_modify_model.get_hookimpls():
            kwargs = {"model": model, "config": config}
            result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            if result is not None:
                model = result
        return model

    def balance_samples(self, samples: list, dp_group: Any) -> list:
        """The samples this data-parallel rank trains on: a ``loongforge_balance_samples`` result, else ``samples``."""
        result = self.pm.hook.loongforge_balance_samples(samples=samples, dp_group=dp_group)
        return samples if result is None else result

    def on_train_start(self, trainer: Any) -> None:
        self.pm.hook.loongforge_on_train_start(trainer=trainer)

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> None:
        self.pm.hook.loongforge_on_step_end(trainer=trainer, step=step, metrics=metrics)

    def on_train_end(self, trainer: Any, metrics: dict) -> None:
        self.pm.hook.loongforge_on_train_end(trainer=trainer, metrics=metrics)

    def on_checkpoint_save(self, trainer: Any, path: str, extra_state: dict) -> None:
        self.pm.hook.loongforge_on_checkpoint_save(trainer=trainer, path=path, extra_state=extra_state)

    def on_checkpoint_load(self, trainer: Any, path: str, extra_state: dict) -> None:
        self.pm.hook.loongforge_on_checkpoint_load(trainer=trainer, path=path, extra_state=extra_state)

    def enable_optimizations(self, settings: dict[str, dict[str, Any]]) -> list[str]:
        """Instantiate the optimizations named in a config and register them as plugins for the run."""
        registry = self.registry("optimization")
        enabled = []
        for name, options in settings.items():
            factory = registry.load(name, where=f"optimizations.{name}")
            self.register(factory(options or {}), f"optimization:{name}")
            enabled.append(name)
        return enabled


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, created (and entry points loaded) on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST


def reset_host(host: PluginHost | None = None) -> None:
    """Replace the process-wide host (tests use this to start from a clean discovery)."""
    global _HOST
    _HOST = host


def get_registry(kind: str) -> Registry:
    """Shorthand for ``get_host().registry(kind)``."""
    return get_host().registry(kind)


def iter_plugins() -> Iterable[PluginInfo]:
    """Loaded plugins with what each registered (fills the registries first)."""
    host = get_host()
    for kind in REGISTRY_KINDS:
        host.registry(kind)
    return host.plugins.values()
