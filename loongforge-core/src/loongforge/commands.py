"""The ``loongforge`` sub-commands plugins add (``loongforge_register_commands``), and the handlers that
dispatching commands choose from.

A plugin adds a command with ``commands.add(name, help=..., configure=..., run=...)``: ``configure(parser)``
puts its arguments on an :class:`argparse.ArgumentParser`, ``run(args) -> int`` does the work. Some commands
apply to many kinds of input -- ``loongforge convert`` (a Hugging Face LLM directory, a Qwen2-VL directory, a
LeRobot checkpoint ...) and ``loongforge eval`` -- so instead of one provider owning them, each plugin adds a
*handler* for its kind with ``commands.add_handler(point, name, accepts=..., claims=..., ...)`` and the command
runs the handler whose ``claims(source, trust_code=...)`` says yes. Core declares the points; it never names what a
plugin handles, and an unclaimed source is refused with one line listing what every handler ``accepts``.

Every command that reads a checkpoint takes ``--trust-code`` (:func:`add_trust_code_option`): a checkpoint's
recorded config may name its model as ``pkg.module:attr``, and importing that module executes it, so it happens
only when the user says the checkpoint is theirs to trust. Dispatch points parse the flag themselves and hand it to
``claims`` (which pass it to :func:`loongforge.claims.checkpoint_model`) and to ``run`` as ``args.trust_code``.

``configure`` and ``run`` may be given as ``"package.module:function"`` strings: a command's module is then
imported only when that command runs, so registration (and ``loongforge --help``) stays torch-free. What claims
usually look at -- the model a checkpoint was trained as, a Hugging Face directory's architecture -- is in
:mod:`loongforge.claims`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loongforge.errors import LoongForgeError
from loongforge.registry import DuplicateComponentError, resolve_import_path

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


class Claims(Protocol):
    """``claims(source, *, trust_code) -> bool``: whether a handler takes ``source``; ``trust_code`` is the user's
    ``--trust-code``, for :func:`loongforge.claims.checkpoint_model`."""

    def __call__(self, source: str, *, trust_code: bool) -> bool: ...


#: A callable, or its ``"package.module:attribute"`` import path (imported when used).
Lazy = Callable | str

#: Dispatch points core's commands choose handlers at: point -> what the source argument is (plugins add conversion
#: directions with :meth:`CommandRegistry.add_conversion`; :meth:`CommandRegistry.points` has them all).
DISPATCH_POINTS: dict[str, str] = {
    "convert hf-to-mcore": "a checkpoint of another framework, converted into a LoongForge checkpoint",
    "convert mcore-to-hf": "a LoongForge checkpoint, converted into another framework's format",
    "eval": "a checkpoint (or an address a plugin serves a model at) to evaluate",
}


def _resolve(target: Lazy) -> Callable:
    return resolve_import_path(target) if isinstance(target, str) else target


def _no_options(parser: argparse.ArgumentParser) -> None:
    """The ``configure`` of a command without arguments."""


def add_trust_code_option(parser: argparse.ArgumentParser, *, checkpoint: str = "the checkpoint") -> None:
    """``--trust-code``, for every command that reads a checkpoint (core's and plugins' alike); ``checkpoint`` says
    which one in the help."""
    parser.add_argument("--trust-code", action="store_true",
                        help=f"let a pkg.module:attr name in the config.yaml of {checkpoint} import that module, "
                             "which runs its code: only for checkpoints you trust")


@dataclass(frozen=True)
class Command:
    """One ``loongforge NAME`` sub-command (or one ``loongforge make-data NAME`` generator)."""

    name: str
    help: str
    provider: str
    configure_target: Lazy
    run_target: Lazy

    def configure(self, parser: argparse.ArgumentParser) -> None:
        _resolve(self.configure_target)(parser)

    def run(self, args: argparse.Namespace) -> int:
        return int(_resolve(self.run_target)(args) or 0)


@dataclass(frozen=True)
class Handler:
    """One plugin's implementation of a dispatch point (see :data:`DISPATCH_POINTS`).

    ``run`` receives the namespace of the point's own arguments (``source``; ``out`` for conversions;
    ``trust_code``) plus those the handler's ``configure`` added.
    """

    point: str
    name: str
    accepts: str
    provider: str
    claims_target: Lazy
    configure_target: Lazy
    run_target: Lazy

    def claims(self, source: str, *, trust_code: bool) -> bool:
        return bool(_resolve(self.claims_target)(source, trust_code=trust_code))

    def configure(self, parser: argparse.ArgumentParser) -> None:
        _resolve(self.configure_target)(parser)

    def run(self, args: argparse.Namespace) -> int:
        return int(_resolve(self.run_target)(args) or 0)


@dataclass(frozen=True)
class Conversion:
    """A direction a plugin added to ``loongforge convert`` (:meth:`CommandRegistry.add_conversion`)."""

    direction: str
    help: str
    source: str
    provider: str


class CommandRegistry:
    """What ``loongforge_register_commands(commands)`` receives; ``current_provider`` is set by the plugin host
    while each plugin's implementation runs, so entries record their distribution."""

    def __init__(self) -> None:
        self.current_provider = "<unknown>"
        self._commands: dict[str, Command] = {}
        self._handlers: dict[tuple[str, str], Handler] = {}
        self._generators: dict[str, Command] = {}  # make-data generators: commands one level down
        self._points: dict[str, str] = dict(DISPATCH_POINTS)
        self._conversions: dict[str, Conversion] = {}  # directions plugins add to ``loongforge convert``

    def add(self, name: str, *, help: str, configure: Lazy = _no_options, run: Lazy) -> None:
        """Add ``loongforge NAME``; a name already taken raises, naming both providers."""
        if not name or name != name.strip().lower() or name.startswith("-"):
            raise LoongForgeError(f"{self.current_provider}: command name {name!r} must be lower-case, no spaces")
        owner = self._commands.get(name)
        if owner is not None:
            raise DuplicateComponentError(
                f"command '{name}' registered twice: by {owner.provider} and by {self.current_provider}"
            )
        self._commands[name] = Command(name, help, self.current_provider, configure, run)

    def add_handler(self, point: str, name: str, *, accepts: str, claims: Lazy, run: Lazy,
                    configure: Lazy = _no_options) -> None:
        """Offer handler ``name`` at ``point`` for the sources ``claims(source, trust_code=...)`` is true of.

        ``accepts`` is the line the refusal of an unclaimed source shows for this handler.
        """
        if point not in self._points:
            raise LoongForgeError(f"{self.current_provider}: unknown dispatch point {point!r}; known: "
                                  f"{', '.join(self._points)}")
        owner = self._handlers.get((point, name))
        if owner is not None:
            raise DuplicateComponentError(f"'{point}' handler '{name}' registered twice: by {owner.provider} and "
                                          f"by {self.current_provider}")
        self._handlers[(point, name)] = Handler(point, name, accepts, self.current_provider, claims, configure, run)

    def add_conversion(self, direction: str, *, help: str, source: str) -> None:
        """Add ``loongforge convert DIRECTION SOURCE OUT``: a conversion core does not know (a plugin's data format,
        say), dispatched like core's directions to the handlers added with ``add_handler(f"convert {direction}",
        ...)``. ``source`` says what SOURCE is (its help, and the reference's); a direction taken twice raises."""
        if not direction or direction != direction.strip().lower() or " " in direction or direction.startswith("-"):
            raise LoongForgeError(f"{self.current_provider}: conversion direction {direction!r} must be one "
                                  "lower-case word")
        point = f"convert {direction}"
        if point in self._points:
            owner = self._conversions.get(direction)
            raise DuplicateComponentError(f"conversion '{point}' registered twice: by "
                                          f"{owner.provider if owner else 'loongforge-core'} and by "
                                          f"{self.current_provider}")
        self._points[point] = source
        self._conversions[direction] = Conversion(direction, help, source, self.current_provider)

    def conversions(self) -> list[Conversion]:
        """The conversion directions plugins added, in registration order."""
        return list(self._conversions.values())

    def points(self) -> dict[str, str]:
        """Every dispatch point -- core's :data:`DISPATCH_POINTS` and the conversions plugins added -- with what its
        source argument is."""
        return dict(self._points)

    def add_generator(self, name: str, *, help: str, run: Lazy, configure: Lazy = _no_options) -> None:
        """Add ``loongforge make-data NAME``: a dataset generator; its ``configure`` must stay torch-free at import
        (every generator's arguments are set up to list them under ``make-data``)."""
        if not name or name != name.strip().lower() or name.startswith("-"):
            raise LoongForgeError(f"{self.current_provider}: generator name {name!r} must be lower-case, no spaces")
        owner = self._generators.get(name)
        if owner is not None:
            raise DuplicateComponentError(f"make-data generator '{name}' registered twice: by {owner.provider} and "
                                          f"by {self.current_provider}")
        self._generators[name] = Command(name, help, self.current_provider, configure, run)

    def generators(self) -> list[Command]:
        """Every ``make-data`` generator, sorted by name."""
        return [self._generators[name] for name in sorted(self._generators)]

    def names(self) -> set[str]:
        """Command names, ``"point:handler"`` and ``"make-data:generator"`` names (what ``loongforge plugins`` lists
        per plugin)."""
        return (set(self._commands) | {f"{point}:{name}" for point, name in self._handlers}
                | {f"make-data:{name}" for name in self._generators})

    def commands(self) -> list[Command]:
        """Every command, sorted by name."""
        return [self._commands[name] for name in sorted(self._commands)]

    def command(self, name: str) -> Command | None:
        return self._commands.get(name)

    def handlers(self, point: str) -> list[Handler]:
        """Handlers of ``point`` in registration order (the order hooks run, see :mod:`loongforge.hookspecs`)."""
        return [handler for (at, _), handler in self._handlers.items() if at == point]

    def handler_for(self, point: str, source: str, *, trust_code: bool = False) -> Handler:
        """The first handler (in registration order) that claims ``source``; else one line saying what each
        registered handler accepts."""
        handlers = self.handlers(point)
        for handler in handlers:
            if handler.claims(source, trust_code=trust_code):
                return handler
        offered = "; ".join(f"{h.name} ({h.provider}): {h.accepts}" for h in handlers) or "none registered"
        raise LoongForgeError(f"loongforge {point}: no registered handler claims '{source}'. "
                              f"Handlers: {offered}")

