"""Experiment trackers (``logging.trackers``): where a run's interval-averaged scalars, its resolved config and its
pictures go besides ``metrics.jsonl``.

Why one small contract (:class:`Tracker`) with a module per tracker: the loop and the tasks must not care whether
TensorBoard, W&B, MLflow or a CSV file listens, and a tracker's optional package (``wandb``, ``mlflow``) is imported
only when the run names it. :class:`Trackers` fans every call out to the chosen trackers and is also the run's
:class:`~loongforge.train.media.MediaLog` (``trainer.media``): it checks each picture once (``uint8``,
``H x W x C`` or ``T x H x W x C``) so that every tracker receives the same, valid arrays.

Only rank 0 opens trackers. wandb and mlflow write files inside the run by default (W&B offline mode, an MLflow
file store), so nothing needs a network or a login. Names and packages are checked by :func:`validate_trackers`
(``loongforge check`` runs it, torch-free) before anything is built.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.errors import ConfigError, LoongForgeError

if TYPE_CHECKING:
    import numpy as np

    from loongforge.config.schema import LoggingConfig, LoongForgeConfig

#: What a hyper-parameter value may be once the config is flattened (``section.key``): what every tracker takes.
Scalar = bool | int | float | str


class Tracker(ABC):
    """One experiment tracker, made as ``Cls(output_dir, logging_config, start_step=...)`` by :func:`open_trackers`.

    Pictures are :class:`~loongforge.train.media.MediaLog` calls with arrays already checked by :class:`Trackers`;
    a tracker that cannot show pictures (csv) keeps the default, which ignores them."""

    #: Where the run's records are and how to look at them, for the closing report (set by ``__init__``).
    location: str

    @abstractmethod
    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        """Record ``values`` at ``step`` as ``<group>/<name>`` (``train`` or ``val``)."""

    @abstractmethod
    def hparams(self, params: Mapping[str, Scalar]) -> None:
        """Record the resolved config, flattened to ``section.key`` names (once, when the run starts)."""

    def images(self, tag: str, images: Sequence[np.ndarray], captions: Sequence[str], *, step: int) -> None:
        """Show ``uint8`` H x W x C ``images`` under ``tag``, each with its caption."""
        return None

    def videos(self, tag: str, videos: Sequence[np.ndarray], captions: Sequence[str], *, step: int,
               fps: int) -> None:
        """Show ``uint8`` T x H x W x C ``videos`` played at ``fps`` under ``tag``, each with its caption."""
        return None

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        """Show a table (``rows`` of text and numbers, one value per column) under ``tag``."""
        return None

    @abstractmethod
    def flush(self) -> None:
        """Put everything recorded so far on disk (called at logging steps and before a checkpoint is saved)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release the tracker (end of the run)."""


@dataclass(frozen=True)
class TrackerKind:
    """A name ``logging.trackers`` accepts: the class (``module:Class``, imported only when used) and the package
    it needs with the ``loongforge-core`` extra that installs it (``""``: a dependency of core itself)."""

    target: str
    package: str
    extra: str


#: Every tracker ``logging.trackers`` may name.
TRACKERS: dict[str, TrackerKind] = {
    "tensorboard": TrackerKind("loongforge.train.trackers.tensorboard_log:TensorBoardTracker", "tensorboard", ""),
    "wandb": TrackerKind("loongforge.train.trackers.wandb_log:WandbTracker", "wandb", "wandb"),
    "mlflow": TrackerKind("loongforge.train.trackers.mlflow_log:MlflowTracker", "mlflow", "mlflow"),
    "csv": TrackerKind("loongforge.train.trackers.csv_log:CsvTracker", "csv", ""),
}


def tracker_names(config: LoongForgeConfig) -> list[str]:
    """The trackers a run uses: ``logging.trackers`` in order, once each, without ``tensorboard`` when the older
    switch ``logging.tensorboard`` is false."""
    names = list(dict.fromkeys(config.logging.trackers))
    return [name for name in names if name != "tensorboard" or config.logging.tensorboard]


def validate_trackers(config: LoongForgeConfig) -> None:
    """Refuse an unknown tracker name, or one whose package is not installed, in one line naming the key."""
    for name in tracker_names(config):
        check_tracker(name, where=f"{config.source}: logging.trackers")


def check_tracker(name: str, *, where: str) -> None:
    """Refuse tracker ``name`` when it is unknown or its package is missing; ``where`` names the setting that gave
    it (a config key, a command-line option) at the start of the one-line error."""
    kind = TRACKERS.get(name)
    if kind is None:
        raise ConfigError(f"{where}: unknown tracker '{name}'; known: {', '.join(sorted(TRACKERS))}")
    if kind.extra and importlib.util.find_spec(kind.package) is None:
        raise ConfigError(f"{where}: '{name}' needs the {kind.package} package: pip install "
                          f"'loongforge-core[{kind.extra}]'")


def open_trackers(config: LoongForgeConfig, *, start_step: int) -> Trackers:
    """The run's trackers (rank 0 only: other ranks pass none to :class:`Trackers`), opened in ``run.output_dir``;
    ``start_step`` is where a resumed run goes on (a file-based tracker drops what a killed run wrote after it)."""
    validate_trackers(config)
    return open_named_trackers(tracker_names(config), Path(config.run.output_dir), config.logging,
                               start_step=start_step)


def open_named_trackers(names: Sequence[str], output_dir: Path, logging: LoggingConfig, *,
                        start_step: int) -> Trackers:
    """Trackers ``names`` (already checked, see :func:`check_tracker`) opened in ``output_dir`` with ``logging``'s
    settings: what a run opens, and what a command that is not a run (``loongforge eval``) opens for its results."""
    opened: dict[str, Tracker] = {}
    try:
        for name in names:
            module, _, cls = TRACKERS[name].target.partition(":")
            opened[name] = getattr(importlib.import_module(module), cls)(output_dir, logging, start_step=start_step)
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)


class Trackers:
    """Every tracker of the run behind one object: the sinks :class:`~loongforge.train.metrics.MetricsWriter`
    writes to, and the run's :class:`~loongforge.train.media.MediaLog`."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None) -> None:
        self._named = dict(trackers or {})
        self._trackers = list(self._named.values())

    def locations(self) -> dict[str, str]:
        """``{tracker name: where its records are}`` (the closing report prints them)."""
        return {name: tracker.location for name, tracker in self._named.items()}

    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        for tracker in self._trackers:
            tracker.scalars(step, values, group)

    def hparams(self, config: Mapping[str, Any]) -> None:
        """Log the resolved config (``config_to_dict``'s nested sections) flattened to ``section.key`` names."""
        if self._trackers:
            params = flatten(config)
            for tracker in self._trackers:
                tracker.hparams(params)

    def images(self, tag: str, images: Sequence[Any], captions: Sequence[str], *, step: int) -> None:
        checked = _pictures(tag, images, captions, ndim=3, what="image")
        for tracker in self._trackers:
            tracker.images(tag, checked, list(captions), step=step)

    def videos(self, tag: str, videos: Sequence[Any], captions: Sequence[str], *, step: int, fps: int) -> None:
        checked = _pictures(tag, videos, captions, ndim=4, what="video")
        if not isinstance(fps, int) or isinstance(fps, bool) or fps < 1:
            raise LoongForgeError(f"media '{tag}': fps must be an integer >= 1, got {fps!r}")
        for tracker in self._trackers:
            tracker.videos(tag, checked, list(captions), step=step, fps=fps)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        if any(len(row) != len(columns) for row in rows):
            raise LoongForgeError(f"table '{tag}': every row needs one value per column ({len(columns)})")
        for tracker in self._trackers:
            tracker.table(tag, list(columns), [list(row) for row in rows], step=step)

    def flush(self) -> None:
        for tracker in self._trackers:
            tracker.flush()

    def close(self) -> None:
        """Close every tracker, even when one of them fails (the first failure is raised afterwards)."""
        failure: BaseException | None = None
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - the others must still close; re-raised below
                failure = failure or exc
        self._named, self._trackers = {}, []
        if failure is not None:
            raise failure


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested sections -> ``{"section.key": value}``; lists and nulls become their JSON text (what a tracker's
    hyper-parameter table can hold)."""
    flat: dict[str, Scalar] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def _pictures(tag: str, pictures: Sequence[Any], captions: Sequence[str], *, ndim: int, what: str) -> list[Any]:
    """``pictures`` as ``uint8`` arrays of ``ndim`` dimensions with 1, 3 or 4 channels, one caption each, or one
    line naming the tag and the picture that is not."""
    import numpy as np

    if len(pictures) != len(captions):
        raise LoongForgeError(f"media '{tag}': {len(pictures)} {what}s but {len(captions)} captions")
    shape = "T x H x W x C" if ndim == 4 else "H x W x C"
    checked = []
    for index, picture in enumerate(pictures):
        array = np.asarray(picture)
        if array.dtype != np.uint8 or array.ndim != ndim or array.shape[-1] not in (1, 3, 4) or 0 in array.shape:
            raise LoongForgeError(f"media '{tag}' {what} {index}: expected a uint8 {shape} array with C in 1, 3, 4; "
                                  f"got {array.dtype} of shape {tuple(array.shape)}")
        checked.append(array)
    return checked


def rgb(image: np.ndarray) -> np.ndarray:
    """An H x W x C image as the trackers' image APIs take it: one channel squeezed to H x W."""
    return image[..., 0] if image.shape[-1] == 1 else image
