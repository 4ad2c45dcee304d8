"""What every action tokenizer provides, and the pieces the kinds share: the saved layout, option parsing and the
repair of malformed id sequences.

A tokenizer maps one action chunk ``(H, D)`` (raw actions, as the dataset stores them) to a list of token ids in
``[0, vocab_size)`` and back. A policy predicts ids, so decoding must accept any sequence -- too short, too long,
ids outside the vocabulary -- and still return an ``(H, D)`` chunk; each kind documents what it fills in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from loongforge.errors import LoongForgeError

#: The file every saved tokenizer has: its kind, options and fitted numbers (JSON, never pickle).
TOKENIZER_FILE = "action_tokenizer.json"

#: Per-dimension statistics of the actions (``{"min", "max", "q01", "q99", ...}``, LeRobot's layout).
ActionStats = Mapping[str, np.ndarray]


class ActionTokenizerError(LoongForgeError, ValueError):
    """A tokenizer that cannot be fitted, used or loaded as asked; the message names the option, chunk or file."""


class ActionTokenizer(Protocol):
    """One fitted tokenizer of action chunks."""

    #: Its registered name (``uniform-bins``, ``quantile-bins``, ``fast``), written into the saved file.
    kind: str

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""

    @property
    def action_dim(self) -> int:
        """``D``, the values per action it was fitted on."""

    def encode(self, chunk: np.ndarray) -> list[int]:
        """The ids of one chunk ``(H, D)`` of raw actions."""

    def decode(self, ids: Sequence[int], horizon: int) -> np.ndarray:
        """The ``(horizon, D)`` chunk of raw actions ``ids`` stand for; never fails on malformed ids."""

    def in_range(self, chunk: np.ndarray) -> np.ndarray:
        """Boolean ``(H, D)``: the values :meth:`error_bound` holds for (those inside the fitted range)."""

    def error_bound(self, horizon: int) -> np.ndarray:
        """``(D,)``: the largest ``|decode(encode(x)) - x|`` per dimension for a chunk whose values are all in
        range (float rounding aside)."""

    def save(self, directory: Path) -> None:
        """Write :data:`TOKENIZER_FILE` (and any file of its own) into ``directory``."""


@dataclasses.dataclass(frozen=True)
class TokenizerKind:
    """A registered kind: its options dataclass, how to fit one on chunks ``(N, H, D)`` with the actions' stats, and
    how to rebuild a saved one from its :data:`TOKENIZER_FILE` contents and directory."""

    options: type
    fit: Callable[[np.ndarray, ActionStats, Any], ActionTokenizer]
    load: Callable[[Mapping[str, Any], Path], ActionTokenizer]


def make_options(kind: str, options_type: type, given: Mapping[str, Any]) -> Any:
    """``options_type(**given)``; an option the kind does not have is one line listing those it has."""
    names = [field.name for field in dataclasses.fields(options_type)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ActionTokenizerError(f"action tokenizer '{kind}' has no option(s) {unknown}; its options: {names}")
    return options_type(**given)


def write_tokenizer_file(directory: Path, kind: str, options: Any, fitted: Mapping[str, Any]) -> None:
    """:data:`TOKENIZER_FILE` with the kind, its options and its fitted numbers (float64 round-trips exactly)."""
    directory.mkdir(parents=True, exist_ok=True)
    body = {"kind": kind, "options": dataclasses.asdict(options),
            "fitted": {key: np.asarray(value).tolist() for key, value in fitted.items()}}
    (directory / TOKENIZER_FILE).write_text(json.dumps(body, indent=1))


def read_array(saved: Mapping[str, Any], key: str, path: Path) -> np.ndarray:
    """``saved["fitted"][key]`` as float64; a missing or non-numeric entry names the file and key."""
    try:
        return np.asarray(saved["fitted"][key], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise ActionTokenizerError(f"{path / TOKENIZER_FILE}: 'fitted.{key}' is missing or not numbers") from None


def check_chunk(chunk: np.ndarray, action_dim: int) -> np.ndarray:
    """``chunk`` as float64 ``(H, D)`` with the fitted ``D``, finite; anything else is one line."""
    array = np.asarray(chunk, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != action_dim:
        raise ActionTokenizerError(f"an action chunk must be (horizon, {action_dim}), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ActionTokenizerError("an action chunk holds NaN or inf")
    return array


def check_chunks(chunks: np.ndarray) -> np.ndarray:
    """Fitting data: float64 ``(N, H, D)`` with at least one finite chunk."""
    array = np.asarray(chunks, dtype=np.float64)
    if array.ndim != 3 or array.shape[0] == 0 or 0 in array.shape:
        raise ActionTokenizerError(f"fit needs action chunks (N, horizon, dims) with N > 0, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ActionTokenizerError("the action chunks to fit on hold NaN or inf")
    return array


def fit_length(values: Sequence[int], size: int, fill: int) -> np.ndarray:
    """``values`` cut to ``size`` or padded with ``fill`` up to it: what a malformed sequence decodes as."""
    array = np.full(size, fill, dtype=np.int64)
    kept = np.asarray(values[:size], dtype=np.int64)
    array[:len(kept)] = kept
    return array
