"""Fitting an action tokenizer of a named kind (:mod:`.names`) on chunks, loading a saved one, and measuring a
round trip."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.action_tokens.base import (
    TOKENIZER_FILE,
    ActionStats,
    ActionTokenizer,
    ActionTokenizerError,
    TokenizerKind,
    check_chunks,
    make_options,
)
from loongforge_embodied.action_tokens.names import ACTION_TOKENIZERS
from loongforge_embodied.data.stats import compute_stats


def tokenizer_kind(name: str, *, where: str = "") -> TokenizerKind:
    """The registered kind ``name``; an unknown one raises the registry's one line with the known names."""
    return ACTION_TOKENIZERS.entry(name, where=where).load()


def fit_action_tokenizer(name: str, chunks: np.ndarray, stats: ActionStats | None = None,
                         **options: Any) -> ActionTokenizer:
    """Fit kind ``name`` on raw action chunks ``(N, H, D)``. ``stats`` (per-dimension, LeRobot's layout, e.g. a
    dataset's exact ``compute_stats()["action"]``) default to the stats of every value of the chunks."""
    entry = ACTION_TOKENIZERS.entry(name)
    kind: TokenizerKind = entry.load()
    chunks = check_chunks(chunks)
    if stats is None:
        stats = compute_stats(chunks.reshape(-1, chunks.shape[2]))
    return kind.fit(chunks, stats, make_options(entry.name, kind.options, options))


def load_action_tokenizer(directory: str | Path) -> ActionTokenizer:
    """The tokenizer :meth:`ActionTokenizer.save` wrote into ``directory``; a missing or malformed file is one line
    naming it. Only JSON is read (no pickle), so a directory that came with a checkpoint is safe to load."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    try:
        saved = json.loads(path.read_text())
        name = saved["kind"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ActionTokenizerError(f"{path}: not a saved action tokenizer ({type(err).__name__}: {err})") from None
    kind = tokenizer_kind(str(name), where=str(path))
    try:
        return kind.load(saved, directory)
    except ActionTokenizerError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise ActionTokenizerError(f"{path}: the saved '{name}' tokenizer does not load ({type(err).__name__}: "
                                   f"{err})") from None


@dataclass(frozen=True)
class RoundTrip:
    """How well a tokenizer reproduces some chunks: errors per dimension, its bound, and the tokens it spends."""

    #: ``(D,)`` largest ``|decode(encode(x)) - x|`` over the values inside the fitted range.
    max_error: np.ndarray
    #: ``(D,)`` the tokenizer's stated bound for those values.
    bound: np.ndarray
    #: Share of values inside the fitted range (the rest are clipped, and their error is not bounded).
    in_range: float
    #: ``(D,)`` largest error over all values, clipped ones included.
    max_error_all: np.ndarray
    chunks: int
    values_per_chunk: int
    tokens_per_chunk: float

    @property
    def compression(self) -> float:
        """Values per token: ``H * D`` over the mean ids per chunk (1 for binning)."""
        return self.values_per_chunk / self.tokens_per_chunk

    @property
    def within_bound(self) -> bool:
        return bool((self.max_error <= self.bound * (1 + 1e-9) + 1e-12).all())

    def to_json(self) -> dict[str, Any]:
        return {"max_error": self.max_error.tolist(), "bound": self.bound.tolist(), "in_range": self.in_range,
                "max_error_all": self.max_error_all.tolist(), "chunks": self.chunks,
                "values_per_chunk": self.values_per_chunk, "tokens_per_chunk": self.tokens_per_chunk,
                "compression": self.compression, "within_bound": self.within_bound}


def measure_round_trip(tokenizer: ActionTokenizer, chunks: np.ndarray) -> RoundTrip:
    """Encode and decode every chunk of ``chunks`` ``(N, H, D)``; see :class:`RoundTrip`."""
    chunks = check_chunks(chunks)
    horizon, dims = chunks.shape[1:]
    errors, inside, lengths = [], [], []
    for chunk in chunks:
        ids = tokenizer.encode(chunk)
        errors.append(np.abs(tokenizer.decode(ids, horizon) - chunk))
        inside.append(tokenizer.in_range(chunk))
        lengths.append(len(ids))
    error, mask = np.stack(errors), np.stack(inside)
    return RoundTrip(max_error=np.where(mask, error, 0.0).max(axis=(0, 1)), bound=tokenizer.error_bound(horizon),
                     in_range=float(mask.mean()), max_error_all=error.max(axis=(0, 1)), chunks=len(chunks),
                     values_per_chunk=horizon * dims, tokens_per_chunk=float(np.mean(lengths)))



def tokenizer_files(tokenizer: ActionTokenizer) -> dict[str, str]:
    """The files :meth:`ActionTokenizer.save` writes, by name, as text: how a policy keeps its tokenizer inside a
    checkpoint's state (plain strings load with ``torch.load(weights_only=True)``)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        return {path.name: path.read_text() for path in sorted(Path(tmp).iterdir())}


def tokenizer_from_files(files: dict[str, str], *, where: str) -> ActionTokenizer:
    """The tokenizer :func:`tokenizer_files` gave ``files``; a malformed one is one line naming ``where``."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            if Path(name).name != name:
                raise ActionTokenizerError(f"{where}: the saved action tokenizer names a file outside its directory: "
                                           f"{name!r}")
            (Path(tmp) / name).write_text(text)
        try:
            return load_action_tokenizer(tmp)
        except ActionTokenizerError as err:
            raise ActionTokenizerError(f"{where}: {str(err).replace(tmp, '<saved tokenizer>')}") from None
