"""Per-dimension binning (RT-2 / OpenVLA): each action value becomes the id of the bin it falls in, shared by all
dimensions, and decodes to that bin's centre.

- ``uniform-bins``: ``bins`` equal-width bins between each dimension's ``min`` and ``max`` (``range: min_max``) or,
  as OpenVLA does, its 1st and 99th percentiles (``range: quantiles``); values outside are clipped to the range;
- ``quantile-bins``: edges at the empirical quantiles ``0, 1/bins, ..., 1`` of each dimension, so every bin holds
  about as many training values -- finer where actions crowd (a gripper's two positions, a held pose).

Round trip: a value inside the range decodes within half the width of its own bin, so ``error_bound`` is half
the widest bin per dimension (``(max - min) / (2 * bins)`` for uniform bins). A dimension that never moves has
zero-width bins and decodes exactly. A chunk is ``H * D`` ids, time-major (``ids[t * D + d]``): compression 1.
Malformed ids decode without failing: ids beyond the vocabulary are clipped to the first/last bin, a short
sequence is padded with the middle bin and a long one is cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.action_tokens.base import (
    ActionStats,
    ActionTokenizerError,
    TokenizerKind,
    check_chunk,
    fit_length,
    read_array,
    write_tokenizer_file,
)

#: ``range`` of uniform bins -> the stats its ends come from.
RANGES = {"min_max": ("min", "max"), "quantiles": ("q01", "q99")}


def _check_bins(bins: int) -> None:
    if not isinstance(bins, int) or bins < 2:
        raise ActionTokenizerError(f"bins must be an integer of at least 2, got {bins!r}")


@dataclass(frozen=True)
class UniformBinOptions:
    """``uniform-bins``: how many bins per dimension, and which stats bound them."""

    bins: int = 256
    #: ``min_max`` (every training value in range) or ``quantiles`` (q01..q99, OpenVLA; outliers clip).
    range: str = "min_max"

    def __post_init__(self) -> None:
        _check_bins(self.bins)
        if self.range not in RANGES:
            raise ActionTokenizerError(f"range '{self.range}' is unknown; choose one of {list(RANGES)}")


@dataclass(frozen=True)
class QuantileBinOptions:
    """``quantile-bins``: how many bins per dimension."""

    bins: int = 256

    def __post_init__(self) -> None:
        _check_bins(self.bins)


class BinTokenizer:
    """Bins given by their edges ``(D, bins + 1)`` (non-decreasing per dimension)."""

    def __init__(self, kind: str, options: UniformBinOptions | QuantileBinOptions, edges: np.ndarray) -> None:
        self.kind, self.options = kind, options
        self.edges = np.asarray(edges, dtype=np.float64)
        if self.edges.ndim != 2 or self.edges.shape[1] != options.bins + 1:
            raise ActionTokenizerError(f"{kind}: edges must be (dims, {options.bins + 1}), got {self.edges.shape}")
        if (np.diff(self.edges, axis=1) < 0).any():
            raise ActionTokenizerError(f"{kind}: bin edges must not decrease along a dimension")
        self.centres = (self.edges[:, 1:] + self.edges[:, :-1]) / 2

    @property
    def vocab_size(self) -> int:
        return self.options.bins

    @property
    def action_dim(self) -> int:
        return self.edges.shape[0]

    def encode(self, chunk: np.ndarray) -> list[int]:
        values = check_chunk(chunk, self.action_dim)
        ids = np.stack([np.searchsorted(self.edges[d, 1:-1], values[:, d], side="right")
                        for d in range(self.action_dim)], axis=1)
        return ids.reshape(-1).tolist()

    def decode(self, ids: Sequence[int], horizon: int) -> np.ndarray:
        fixed = fit_length(ids, horizon * self.action_dim, self.options.bins // 2)
        index = np.clip(fixed, 0, self.options.bins - 1).reshape(horizon, self.action_dim)
        return np.take_along_axis(self.centres.T, index, axis=0)

    def in_range(self, chunk: np.ndarray) -> np.ndarray:
        values = check_chunk(chunk, self.action_dim)
        return (values >= self.edges[:, 0]) & (values <= self.edges[:, -1])

    def error_bound(self, horizon: int) -> np.ndarray:
        return np.diff(self.edges, axis=1).max(axis=1) / 2

    def save(self, directory: Path) -> None:
        write_tokenizer_file(Path(directory), self.kind, self.options, {"edges": self.edges})


def fit_uniform(chunks: np.ndarray, stats: ActionStats, options: UniformBinOptions) -> BinTokenizer:
    """Equal-width bins between the stats ``options.range`` names (the chunks only give the dimension count)."""
    low_name, high_name = RANGES[options.range]
    low, high = (np.asarray(stats[name], dtype=np.float64).reshape(-1) for name in (low_name, high_name))
    if low.shape != (chunks.shape[2],) or (high < low).any():
        raise ActionTokenizerError(f"uniform-bins: stats {low_name}/{high_name} must give {chunks.shape[2]} values "
                                   f"with {low_name} <= {high_name}, got {low.tolist()} / {high.tolist()}")
    return BinTokenizer("uniform-bins", options, np.linspace(low, high, options.bins + 1, axis=1))


def fit_quantile(chunks: np.ndarray, stats: ActionStats, options: QuantileBinOptions) -> BinTokenizer:
    """Edges at the quantiles of every value of every chunk, per dimension."""
    values = chunks.reshape(-1, chunks.shape[2])
    return BinTokenizer("quantile-bins", options, np.quantile(values, np.linspace(0, 1, options.bins + 1), axis=0).T)


def _loader(kind: str, options_type: type):
    def load(saved: Mapping[str, Any], directory: Path) -> BinTokenizer:
        return BinTokenizer(kind, options_type(**saved["options"]), read_array(saved, "edges", directory))

    return load


UNIFORM = TokenizerKind(UniformBinOptions, fit_uniform, _loader("uniform-bins", UniformBinOptions))
QUANTILE = TokenizerKind(QuantileBinOptions, fit_quantile, _loader("quantile-bins", QuantileBinOptions))
