"""Named-component registries that config names resolve through.

Plugins fill these through collector hooks (``loongforge_register_models(registry)`` ...). A registry maps
a kebab-case name (plus aliases such as Hugging Face ids) to a target, which is either the object itself or
a lazy ``"package.module:attribute"`` string: registering must stay cheap and torch-free so that
``loongforge plugins`` and ``loongforge list`` answer instantly; the target is imported only when a run uses it.

Resolution failures raise :class:`UnknownComponentError`. When the name belongs to a first-party plugin (the
catalog ``first_party_plugins.json``) that is disabled here or not installed, the message says so -- which variable
disabled it, or the ``pip install`` line -- instead of suggesting a look-alike name; otherwise it lists the known
names, a did-you-mean and the disabled plugins that may hold the name.

A config may also name a component outside every registry as ``pkg.module:attr`` (:func:`resolve_import_path`).
That escape hatch *executes code*: importing a module runs it. It is right for a config the user wrote (their file,
like a script) and wrong for one that came with a checkpoint, so names from a checkpoint's config resolve through
:meth:`Registry.without_imports`, which refuses import paths unless the user passed ``--trust-code``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.resources
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loongforge.errors import LoongForgeError, UntrustedCheckpointError

#: The catalog of first-party distributions and the names they provide (a data file; see its ``about``).
FIRST_PARTY_CATALOG = "first_party_plugins.json"


class UnknownComponentError(LoongForgeError, KeyError):
    """A config named a component that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0])


class DuplicateComponentError(LoongForgeError):
    """Two plugins registered the same name; the message names both providers."""


@dataclass
class Entry:
    """One registered component."""

    name: str
    target: Any
    provider: str
    description: str = ""
    aliases: tuple[str, ...] = ()
    #: The name as the provider spelt it (``name`` is lower-cased for lookup): ``LlamaForCausalLM``.
    label: str = ""
    _loaded: Any = field(default=None, repr=False)

    def load(self) -> Any:
        """Return the target, importing it first if it was registered as ``"module:attr"``."""
        if self._loaded is None:
            self._loaded = resolve_import_path(self.target) if isinstance(self.target, str) else self.target
        return self._loaded


def resolve_import_path(path: str) -> Any:
    """Import ``"package.module:attribute"`` (the escape hatch for components outside any registry).

    Importing runs the module's code: call this only for names the user (or an installed plugin) chose.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise LoongForgeError(f"'{path}' is not an import path of the form package.module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoongForgeError(f"cannot import '{module_name}' for '{path}': {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LoongForgeError(f"'{module_name}' has no attribute '{attr}' (from '{path}')") from None
    return obj


class Registry:
    """Names of one kind of component (``model``, ``device``, ...) -> entries.

    ``current_provider`` is set by the plugin manager while a plugin's collector hook runs, so entries
    record which distribution provided them without plugins having to say so.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        self.current_provider = "<unknown>"
        #: Installed plugins not loaded here: plugin name -> (distribution, the variable that disabled it).
        self.disabled: dict[str, tuple[str, str]] = {}
        #: Whether :meth:`load` imports ``pkg.module:attr`` names; false in a :meth:`without_imports` view.
        self.imports_allowed = True

    def without_imports(self) -> Registry:
        """These names, for resolving a config the user did not write (a checkpoint's config.yaml read without
        ``--trust-code``): :meth:`load` refuses a ``pkg.module:attr`` name instead of importing, that is running,
        its module. Registered entries still load; their code is an installed plugin's."""
        view = copy.copy(self)  # shares the entries: a view, not a second registry
        view.imports_allowed = False
        return view

    def register(
        self, name: str, target: Any, *, aliases: tuple[str, ...] | list[str] = (), description: str = ""
    ) -> None:
        """Add ``name`` (and its aliases). A name already taken raises, naming both providers."""
        key = self._normalise(name)
        if not key:
            raise LoongForgeError(f"{self.current_provider}: cannot register a {self.kind} with an empty name")
        for candidate in (key, *(self._normalise(a) for a in aliases)):
            owner = self._entries.get(candidate) or self._entries.get(self._aliases.get(candidate, ""))
            if owner is not None:
                raise DuplicateComponentError(
                    f"{self.kind} '{candidate}' registered twice: by {owner.provider} and by {self.current_provider}"
                )
        self._entries[key] = Entry(key, target, self.current_provider, description, tuple(aliases), label=name.strip())
        for alias in aliases:
            self._aliases[self._normalise(alias)] = key

    def names(self) -> list[str]:
        """Registered canonical names, sorted."""
        return sorted(self._entries)

    def entries(self) -> Iterator[Entry]:
        """Entries in name order."""
        return (self._entries[n] for n in self.names())

    def __contains__(self, name: str) -> bool:
        key = self._normalise(name)
        return key in self._entries or key in self._aliases

    def entry(self, name: str, *, where: str = "") -> Entry:
        """The entry for ``name`` or an alias; ``where`` (e.g. "model in run.yaml") goes in the error."""
        key = self._normalise(name)
        key = self._aliases.get(key, key)
        if key in self._entries:
            return self._entries[key]
        raise UnknownComponentError(self.unknown_message(name, where))

    def load(self, name: str, *, where: str = "") -> Any:
        """Resolve ``name`` to its target; ``pkg.module:attr`` names are imported directly (which runs the module's
        code), unless this is a :meth:`without_imports` view, where they raise :class:`UntrustedCheckpointError`."""
        if ":" in name and name not in self:
            if not self.imports_allowed:
                raise UntrustedCheckpointError(
                    f"{where or self.kind}: '{name}' is an import path in a config that came with a checkpoint, and "
                    "importing it would run that module's code; pass --trust-code (or set run.trust_code: true) "
                    "only for checkpoints you trust"
                )
            return resolve_import_path(name)
        return self.entry(name, where=where).load()

    def unknown_message(self, name: str, where: str = "") -> str:
        """One line: what is unknown and where; then either why (the first-party plugin providing it is disabled or
        not installed) or the known names, a did-you-mean and the disabled plugins that may provide it. A known
        reason replaces the did-you-mean, which would point at an unrelated name that merely looks alike."""
        location = f" ({where})" if where else ""
        parts = [f"Unknown {self.kind} '{name}'{location}."]
        reason = missing_provider_reason(self.kind, name, self.disabled)
        if reason is not None:
            return " ".join([*parts, reason])
        known = self.names()
        parts.append(f"Known: {', '.join(known) if known else '(none registered)'}.")
        close = difflib.get_close_matches(self._normalise(name), known + sorted(self._aliases), n=1, cutoff=0.6)
        if close:
            parts.append(f"Did you mean '{self._aliases.get(close[0], close[0])}'?")
        parts.extend(disabled_plugins_hint(self.disabled))
        return " ".join(parts)

    @staticmethod
    def _normalise(name: str) -> str:
        return name.strip().lower()


@functools.cache
def first_party_catalog() -> tuple[tuple[str, re.Pattern[str], str], ...]:
    """``(kind, name pattern, distribution)`` rows of :data:`FIRST_PARTY_CATALOG`."""
    raw = json.loads(importlib.resources.files("loongforge").joinpath(FIRST_PARTY_CATALOG).read_text())
    return tuple((row["kind"], re.compile(row["pattern"]), row["distribution"]) for row in raw["providers"])


def first_party_provider(kind: str, name: str) -> str | None:
    """The first-party distribution whose names match ``name``, if any."""
    lowered = name.lower()
    for pattern_kind, pattern, dist in first_party_catalog():
        if pattern_kind == kind and pattern.search(lowered):
            return dist
    return None


def missing_provider_reason(kind: str, name: str, disabled: dict[str, tuple[str, str]]) -> str | None:
    """Why ``name`` is missing when its first-party plugin (:data:`FIRST_PARTY_CATALOG`) is known: that plugin is
    disabled here (by which variable, and how to undo it) or not installed (the ``pip install`` line); else None."""
    provider = first_party_provider(kind, name)
    if provider is None:
        return None
    for plugin, (dist, variable) in disabled.items():
        if dist == provider:
            undo = (f"add '{plugin}' to {variable}" if variable == "LOONGFORGE_LOAD_PLUGINS"
                    else f"remove it from {variable}")
            return f"It is provided by plugin {dist}, and plugin {dist} is disabled by {variable}: {undo} to use it."
    if not _is_installed(provider):
        return f"'{name}' is provided by {provider}, which is not installed: pip install {provider}"
    return None


def disabled_plugins_hint(disabled: dict[str, tuple[str, str]]) -> list[str]:
    """The disabled plugins, for a name no catalog row places: a disabled plugin's names cannot be known without
    loading it, so each one may be where the name lives."""
    if not disabled:
        return []
    listed = ", ".join(f"'{plugin}' ({variable})" for plugin, (_, variable) in sorted(disabled.items()))
    return [f"Disabled plugins, which may provide it: {listed}."]


def _is_installed(distribution: str) -> bool:
    from importlib_metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def plural(kind: str) -> str:
    """``strategy`` -> ``strategies``, ``model`` -> ``models`` (for listings and CLI choices)."""
    return f"{kind[:-1]}ies" if kind.endswith("y") else f"{kind}s"


#: Registry kinds, in the order ``loongforge list`` shows them. Each has a collector hook
#: ``loongforge_register_<kind>s``.
REGISTRY_KINDS: tuple[str, ...] = ("device", "model", "strategy", "dataset", "tokenizer", "optimization",
                                   "hf_architecture", "reward", "certification_recipe")
