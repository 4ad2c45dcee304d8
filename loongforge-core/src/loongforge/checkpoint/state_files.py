"""The small files a resume reads beside the weights -- ``trainer.json``, each rank's ``.pt`` state -- checked before
anything uses them, each failure one line naming the file and the key.

Why: the manifest proves the files are the ones that were saved, not that they hold what a loader expects, and it can
be recomputed by anyone who edits a checkpoint (or written by a buggy plugin). A ``trainer.json`` that is not JSON,
lacks a key, holds a string where a count belongs or a negative ``consumed_samples`` used to end a resume in a
``KeyError`` or ``TypeError`` traceback -- or worse, in a run that went on from a nonsensical data position. A rank
file that would run code when unpickled was refused only by torch's multi-paragraph ``weights_only`` traceback.

Everything here is torch-free except :func:`load_plain`, which imports torch when called, and
:func:`restore_checked`, when the restore it runs failed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loongforge.checkpoint.manifest import CheckpointCorruptError

#: A value check: ``(predicate, what the value must be)``.
Check = tuple[Callable[[Any], bool], str]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive(value: Any) -> bool:
    return _count(value) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


COUNT: Check = (_count, "an integer >= 0")
POSITIVE: Check = (_positive, "an integer >= 1")
NUMBER: Check = (_number, "a finite number")
INTEGER: Check = (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
TEXT: Check = (lambda v: isinstance(v, str), "a string")
MAPPING: Check = (lambda v: isinstance(v, Mapping), "a mapping")

#: What megatron's ``OptimizerParamScheduler.state_dict`` holds (``load_state_dict`` reads every one of them).
SCHEDULER_KEYS: dict[str, Check] = {
    "max_lr": NUMBER, "min_lr": NUMBER, "lr_warmup_steps": COUNT, "lr_decay_steps": COUNT, "lr_decay_style": TEXT,
    "num_steps": COUNT, "start_wd": NUMBER, "end_wd": NUMBER, "wd_incr_steps": COUNT, "wd_incr_style": TEXT,
}
#: The data position the core sampler stores (:class:`loongforge.data.sampler.GlobalBatchSampler`); plugins' data
#: iterators may store more keys, which their own ``load_state_dict`` checks.
DATA_KEYS: dict[str, Check] = {"consumed_samples": COUNT, "seed": INTEGER, "num_samples": COUNT}

#: ``trainer.json`` of a megatron-engine checkpoint: key -> (required, check). ``data``'s keys are checked when
#: present (:data:`DATA_KEYS`), ``scheduler``'s always (:data:`SCHEDULER_KEYS`).
MEGATRON_TRAINER: dict[str, tuple[bool, Check]] = {
    "step": (True, COUNT), "optimizer_steps": (True, COUNT), "scheduler": (True, MAPPING), "data": (True, MAPPING),
    "extra_state": (False, MAPPING), "schedule_settings": (False, MAPPING),
}
#: ``trainer.json`` of a task-engine checkpoint.
TASK_TRAINER: dict[str, tuple[bool, Check]] = {
    "step": (True, COUNT), "model": (True, TEXT), "world_size": (False, POSITIVE), "extra_state": (False, MAPPING),
    "schedule_settings": (False, MAPPING), "scheduler_samples": (False, COUNT),
}
#: A task checkpoint's ``state.pt``.
TASK_STATE: dict[str, tuple[bool, Check]] = {"task": (True, MAPPING), "data_position": (True, COUNT)}
#: The random streams of :func:`loongforge.checkpoint.rng.capture_rng_state`.
RNG_STREAMS = ("python", "numpy", "torch", "device", "megatron_tracker")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_fields(data: Any, fields: Mapping[str, tuple[bool, Check]], where: str, prefix: str = "") -> dict:
    """``data`` as a dict after checking it against ``fields`` (key -> (required, check)); the first problem is a
    :class:`CheckpointCorruptError` naming ``where`` (the file) and the key."""
    if not isinstance(data, Mapping):
        raise CheckpointCorruptError(f"{where}: holds {type(data).__name__} {_shown(data)}, not a mapping of the "
                                     "saved state")
    for key, (required, (ok, meaning)) in fields.items():
        if key not in data:
            if required:
                raise CheckpointCorruptError(f"{where}: '{prefix}{key}' is missing")
            continue
        if not ok(data[key]):
            raise CheckpointCorruptError(f"{where}: '{prefix}{key}' must be {meaning}, got {_shown(data[key])}")
    return dict(data)


def _checked(data: Mapping, key: str, fields: Mapping[str, Check], where: str, *, all_required: bool) -> None:
    check_fields(data[key], {name: (all_required, check) for name, check in fields.items()}, where, f"{key}.")


def read_json(path: Path) -> Any:
    """The JSON in ``path``; a missing, unreadable or malformed file is one line naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path}: not valid JSON ({exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"the non-JSON number {name}")


def megatron_trainer_state(path: Path) -> dict[str, Any]:
    """A megatron-engine checkpoint's ``trainer.json`` (``path`` is the file), checked: step and optimizer step
    counts, the learning-rate scheduler's state, the data position, plugin ``extra_state``, recorded settings."""
    where = str(path)
    data = check_fields(read_json(path), MEGATRON_TRAINER, where)
    _checked(data, "scheduler", SCHEDULER_KEYS, where, all_required=True)
    _checked(data, "data", DATA_KEYS, where, all_required=False)
    return data


def task_trainer_state(path: Path) -> dict[str, Any]:
    """A task-engine checkpoint's ``trainer.json`` (``path`` is the file), checked."""
    return check_fields(read_json(path), TASK_TRAINER, str(path))


def load_plain(path: Path, what: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` with one-line errors: a file that would run code (any pickled global
    torch's allow-list refuses) is an :class:`~loongforge.errors.UntrustedCheckpointError` naming the global, a
    missing or damaged one a :class:`CheckpointCorruptError`; ``what`` says what the file is for."""
    import pickle

    import torch

    from loongforge.checkpoint.trust import _weights_only_reason
    from loongforge.errors import UntrustedCheckpointError

    named = f"{path}{f' ({what})' if what else ''}"
    if not path.is_file():
        raise CheckpointCorruptError(f"{named}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UntrustedCheckpointError(
            f"{named} is not plain data ({_weights_only_reason(exc)}); loading it would run code chosen by whoever "
            "wrote the checkpoint, so it was refused") from None
    except Exception as exc:  # not a torch.save file at all: truncated zip, garbage  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointCorruptError(f"{named}: unreadable ({type(exc).__name__}: {first})") from None


def rng_state(data: Any, path: Path, key: str | None = None) -> dict[str, Any]:
    """The random streams in a rank's state file (``data[key]``, or ``data`` itself), checked for every stream."""
    where = str(path)
    if key is not None:
        data = check_fields(data, {key: (True, MAPPING)}, where)[key]
        prefix = f"{key}."
    else:
        prefix = ""
    return check_fields(data, {name: (True, (lambda v: v is not None, "present")) for name in RNG_STREAMS}, where,
                        prefix)


def restore_checked(restore: Callable[[], None], path: Path, what: str) -> None:
    """Run ``restore`` (which puts ``what`` from ``path`` in place); the errors of a value of the wrong shape
    (``TypeError``, ``ValueError``, ``KeyError``, ``IndexError``, torch's ``RuntimeError``) become one line. A
    collective that failed (torch's ``DistError``, a ``RuntimeError`` too: another rank died during a sharded load) is
    no fault of the file and stays what it is, so that the launcher restarts the job rather than give up on it."""
    try:
        restore()
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        from torch.distributed import DistError

        if isinstance(exc, DistError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorruptError(f"{path}: {what} cannot be restored ({type(exc).__name__}: {first})") from None
