"""The plugin manager: discovers plugins, fills the registries, and calls lifecycle hooks.

Plugins are modules named by entry points in the ``loongforge`` group (``core`` is LoongForge's own parts,
registered through the same hooks). Core code never calls ``pm.hook.*`` directly: it goes through the
typed methods of :class:`PluginHost`, which keeps hook names and argument names checked in one place.

Environment controls:

* ``LOONGFORGE_DISABLE_PLUGINS=a,b`` — do not load these plugins (block list).
* ``LOONGFORGE_LOAD_PLUGINS=a,b`` — load only these plugins (allow list); ``core`` always loads.

Either list names a plugin by its entry-point name (``vlm``) or its distribution (``loongforge-vlm``); a name
that matches no installed plugin is warned about rather than ignored.

A plugin that fails to import, or implements a hook that does not exist (a typo), raises
:class:`PluginLoadError` naming the plugin, its distribution and version, and how to disable it.

Every hook -- collector, chained, firstresult or lifecycle -- is called by :meth:`PluginHost._implementations`'s
order, stated in :mod:`loongforge.hookspecs`: ``tryfirst`` implementations, then plain, then ``trylast``; inside
each group in registration order (core first). pluggy's own call loop (last registered first) is never used, so
one order holds for every hook.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy
from importlib_metadata import entry_points

from loongforge import hookspecs
from loongforge.commands import CommandRegistry
from loongforge.errors import PluginLoadError
from loongforge.registry import REGISTRY_KINDS, Registry

if TYPE_CHECKING:
    from pluggy import HookImpl

    from loongforge.config.schema import LoongForgeConfig
    from loongforge.train.trainer import Trainer

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
    "hf_architecture": "loongforge_register_hf_architectures",
    "reward": "loongforge_register_rewards",
    "certification_recipe": "loongforge_register_certification_recipes",
}
_COMMANDS_COLLECTOR = "loongforge_register_commands"


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
    return {_plugin_key(item) for item in os.environ.get(var, "").split(",") if item.strip()}


def _plugin_key(name: str) -> str:
    """How a plugin is matched in the environment lists: its entry-point name (``vlm``) or its distribution
    (``loongforge-vlm``, ``loongforge_vlm``), case and ``_``/``-`` aside -- users copy either from
    ``loongforge plugins``, and a spelling that silently disabled nothing would be worse than either."""
    return name.strip().lower().replace("_", "-")


class PluginHost:
    """A typed wrapper around pluggy's manager for the ``loongforge`` project."""

    def __init__(self, *, autoload: bool = True) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        #: Entry-point plugins not loaded because of LOONGFORGE_DISABLE_PLUGINS / LOONGFORGE_LOAD_PLUGINS:
        #: plugin name -> (distribution, the variable that disabled it). Unknown-name errors mention them.
        self.disabled: dict[str, tuple[str, str]] = {}
        self._registries: dict[str, Registry] | None = None
        self._commands: CommandRegistry | None = None
        #: plugin name -> registration index: the order hook implementations run in (see hookspecs).
        self._registration_order: dict[str, int] = {}
        self._registrations = itertools.count()
        if autoload:
            self._load_entry_points()

    # -- discovery -------------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        blocked = _env_list("LOONGFORGE_DISABLE_PLUGINS")
        allowed = _env_list("LOONGFORGE_LOAD_PLUGINS")
        seen: set[str] = set()
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name != CORE_PLUGIN, e.name)):
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown distribution>"
            keys = {_plugin_key(ep.name), _plugin_key(dist_name)}
            seen |= keys
            if ep.name != CORE_PLUGIN and (keys & blocked or (allowed and not keys & allowed)):
                why = "LOONGFORGE_DISABLE_PLUGINS" if keys & blocked else "LOONGFORGE_LOAD_PLUGINS"
                self.disabled[ep.name] = (dist_name, why)
                continue
            version = dist.version if dist is not None else "?"
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must name the plugin
                raise PluginLoadError(self._broken(ep.name, dist_name, version, f"failed to import: {exc!r}")) from exc
            self.register(module, ep.name, distribution=dist_name, version=version)
        for var, names in (("LOONGFORGE_DISABLE_PLUGINS", blocked), ("LOONGFORGE_LOAD_PLUGINS", allowed)):
            if names - seen:
                installed = ", ".join(sorted(self.plugins.keys() | self.disabled.keys()))
                print(f"[loongforge] warning: {var} names no installed plugin: {', '.join(sorted(names - seen))} "
                      f"(installed: {installed})", file=sys.stderr, flush=True)

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
            _refuse_wrappers(self.pm, plugin)
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginLoadError(self._broken(name, distribution, version, f"is invalid: {exc}")) from None
        self._registration_order[name] = next(self._registrations)
        module = getattr(plugin, "__name__", type(plugin).__name__)
        summary = getattr(plugin, "SUMMARY", None) or (plugin.__doc__ or "").strip().splitlines()[0:1]
        summary = summary if isinstance(summary, str) else "".join(summary)
        self.plugins[name] = PluginInfo(name, distribution, version, module, summary)
        self._registries = None
        self._commands = None

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` (a no-op when absent)."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.plugins.pop(name, None)
        self._registration_order.pop(name, None)
        self._registries = None
        self._commands = None

    # -- call order --------------------------------------------------------------------------------

    def _implementations(self, hook_name: str) -> list[HookImpl]:
        """``hook_name``'s implementations in the order LoongForge calls them (stated in hookspecs):
        tryfirst, plain, trylast; registration order inside each group."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        late = sys.maxsize  # registered on self.pm directly, behind the host's back: after every known plugin
        return sorted(impls, key=lambda impl: (0 if impl.tryfirst else 2 if impl.trylast else 1,
                                               self._registration_order.get(impl.plugin_name, late)))

    def _call(self, hook_name: str, *, firstresult: bool = False, **kwargs: Any) -> list[Any]:
        """Call every implementation in order with the arguments it takes; return the non-None results (only the
        first one with ``firstresult``)."""
        results = []
        for impl in self._implementations(hook_name):
            result = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            if result is not None:
                results.append(result)
                if firstresult:
                    break
        return results

    def implements(self, hook_name: str) -> bool:
        """Whether any registered plugin implements ``hook_name`` (a data path offers balancing only then)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

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
        self._commands = None  # collected again, so that each plugin's ``registered`` lists its commands too
        for kind, hook_name in _COLLECTORS.items():
            registry = registries[kind]
            registry.disabled = dict(self.disabled)
            self._collect_into(registry, hook_name, functools.partial(_names, registry), kind)
        return registries

    def _collect_into(self, target: Registry | CommandRegistry, hook_name: str, names: Callable[[], set[str]],
                      kind: str) -> None:
        """Call ``hook_name``'s implementations one by one (in the stated order) with ``target``, so each entry
        records its provider and each plugin what it added; a failure names the plugin."""
        for impl in self._implementations(hook_name):
            info = self.plugins.get(impl.plugin_name)
            target.current_provider = info.distribution if info else impl.plugin_name
            before = names()
            try:
                impl.function(**{arg: target for arg in impl.argnames})
            except PluginLoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - name the plugin whose registration broke
                dist, ver = (info.distribution, info.version) if info else ("?", "?")
                raise PluginLoadError(
                    self._broken(impl.plugin_name, dist, ver, f"failed in {hook_name}: {exc}")
                ) from exc
            added = sorted(names() - before)
            if info is not None and added:
                info.registered.setdefault(kind, []).extend(added)
        target.current_provider = "<unknown>"

    def commands(self) -> CommandRegistry:
        """The ``loongforge`` sub-commands and dispatch handlers every plugin (core included) registered."""
        if self._commands is None:
            commands = CommandRegistry()
            self._collect_into(commands, _COMMANDS_COLLECTOR, commands.names, "command")
            self._commands = commands
        return self._commands

    # -- lifecycle ---------------------------------------------------------------------------------

    def configure(self, config: LoongForgeConfig) -> None:
        self._call("loongforge_configure", config=config)

    def modify_model(self, model: list[Any], config: LoongForgeConfig) -> list[Any]:
        """Chain ``loongforge_modify_model`` in the stated order; each implementation may return a replacement
        that the next one receives."""
        for impl in self._implementations("loongforge_modify_model"):
            kwargs = {"model": model, "config": config}
            result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            if result is not None:
                model = result
        return model

    def balance_samples(self, samples: list, dp_group: Any) -> list:
        """The samples this data-parallel rank trains on: a ``loongforge_balance_samples`` result, else ``samples``."""
        results = self._call("loongforge_balance_samples", firstresult=True, samples=samples, dp_group=dp_group)
        return results[0] if results else samples

    def on_train_start(self, trainer: Trainer) -> None:
        self._call("loongforge_on_train_start", trainer=trainer)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self._call("loongforge_on_step_end", trainer=trainer, step=step, metrics=metrics)

    def on_train_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self._call("loongforge_on_train_end", trainer=trainer, metrics=metrics)

    def on_checkpoint_save(self, trainer: Trainer, path: str, extra_state: dict[str, Any]) -> None:
        self._call("loongforge_on_checkpoint_save", trainer=trainer, path=path, extra_state=extra_state)

    def on_checkpoint_load(self, trainer: Trainer, path: str, extra_state: dict[str, Any]) -> None:
        self._call("loongforge_on_checkpoint_load", trainer=trainer, path=path, extra_state=extra_state)

    def enable_optimizations(self, settings: dict[str, dict[str, Any]]) -> list[str]:
        """Instantiate the optimizations named in a config and register them as plugins for the run."""
        registry = self.registry("optimization")
        enabled = []
        for name, options in settings.items():
            factory = registry.load(name, where=f"optimizations.{name}")
            self.register(factory(options or {}), f"optimization:{name}")
            enabled.append(name)
        return enabled


def _names(registry: Registry) -> set[str]:
    return set(registry.names())


def _refuse_wrappers(pm: pluggy.PluginManager, plugin: Any) -> None:
    """Wrapper implementations would run outside the stated order (see hookspecs); refuse them."""
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                raise pluggy.PluginValidationError(
                    plugin, f"{impl.function.__name__} is a wrapper; LoongForge calls hooks in one stated order and "
                    "takes no wrapper/hookwrapper implementations (chain through loongforge_modify_model instead)")


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
    host.commands()
    return host.plugins.values()
