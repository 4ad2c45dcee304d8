"""Fit ``(a, b, c, d, e)`` of the cost model from measured times (non-negative least squares).

Two kinds of measurement:

* :func:`fit_cost_model` — one time per rank (that rank's own compute, e.g. forward/backward before the gradient
  all-reduce): ``time = load_features(rank lengths, rank encoder work) . (a, b, c, d, e)``, a plain linear fit.
* :func:`fit_from_steps` — one time per step, which is what a trainer measures: every rank waits in the gradient
  all-reduce for the slowest, so ``step time = max over ranks of the rank's load + a fixed overhead`` (optimizer
  step, communication). Which rank was slowest depends on the coefficients, so the fit alternates: guess the
  slowest rank of every step, fit, re-pick the slowest with the new coefficients, until the picks stop changing.
  Use clearly more steps than the unknowns: with few steps, a wrong choice of slowest ranks can fit as well.

The encoder terms (``d`` per patch, ``e`` per patch pair) are fitted only when some measured sample has patches:
on text alone they stay 0. Patches and LLM tokens rise together for one kind of media, so their split is only
pinned down by a mix (text and images, short and long videos); the sum is what balancing reads.

Residuals are relative (each row divided by its time): measured times have roughly proportional noise, and a
plain fit would let the longest steps decide everything. The solve is exact non-negative least squares by
trying every set of free coefficients (at most 6 columns, so 63 small solves) — no SciPy needed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from loongforge_balance.dp_balance.cost import CostModel, load_features

MAX_ROUNDS = 50


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin ||x w - y||`` over ``w >= 0`` for a handful of columns, by enumerating the free set."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_residual = np.zeros(x.shape[1]), float(np.dot(y, y))
    for size in range(1, x.shape[1] + 1):
        for free in itertools.combinations(range(x.shape[1]), size):
            w, *_ = np.linalg.lstsq(xs[:, free], y, rcond=None)
            if np.any(w < 0):
                continue
            residual = float(np.sum((xs[:, free] @ w - y) ** 2))
            if residual < best_residual:
                best = np.zeros(x.shape[1])
                best[list(free)] = w
                best_residual = residual
    return best / scale


def _relative_nnls(x: np.ndarray, times: np.ndarray) -> np.ndarray:
    return nnls(x / times[:, None], np.ones_like(times))


def _check_times(times: Sequence[float], count: int, what: str) -> np.ndarray:
    y = np.asarray(times, dtype=np.float64)
    if y.shape != (count,):
        raise ValueError(f"got {y.size} times for {count} {what}")
    if count < 4:
        raise ValueError(f"need at least 4 {what} to fit 3 cost coefficients, got {count}")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"times must be finite and > 0, got {y.tolist()}")
    return y


def _vision_columns(features: np.ndarray) -> list[int]:
    """The encoder columns (3: patches, 4: patch pairs) that some measurement has, to fit."""
    return [column for column in (3, 4) if np.any(features[..., column] > 0)]


def fit_cost_model(rank_lengths: Sequence[Sequence[int]], times: Sequence[float],
                   rank_encoder: Sequence[np.ndarray | None] | None = None) -> CostModel:
    """Coefficients from ``(a rank's sample lengths, that rank's compute time)`` pairs; ``rank_encoder`` gives each
    rank's samples' encoder work ``[samples, 2]`` (None: text)."""
    y = _check_times(times, len(rank_lengths), "rank measurements")
    encoder = rank_encoder or [None] * len(rank_lengths)
    x = np.stack([load_features(lengths, work) for lengths, work in zip(rank_lengths, encoder, strict=True)])
    columns = [0, 1, 2, *_vision_columns(x)]
    coefficients = np.zeros(5)
    coefficients[columns] = _relative_nnls(x[:, columns], y)
    return CostModel(*coefficients.tolist())


def fit_from_steps(
    step_rank_lengths: Sequence[Sequence[Sequence[int]]], step_times: Sequence[float],
    step_rank_encoder: Sequence[Sequence[np.ndarray | None]] | None = None,
) -> tuple[CostModel, float]:
    """Coefficients and the per-step overhead from ``(every rank's sample lengths, the step's time)`` pairs;
    ``step_rank_encoder`` gives every rank's samples' encoder work per step (None: text).

    If every rank held the same number of samples in every step (a fixed micro-batch size), the per-sample
    constant ``c`` cannot be told apart from the per-step overhead; it is then attributed to the step (``c = 0``),
    which is harmless for balancing because a constant added to every rank moves no sample.
    """
    y = _check_times(step_times, len(step_rank_lengths), "steps")
    encoder = step_rank_encoder or [[None] * len(ranks) for ranks in step_rank_lengths]
    features = [np.stack([load_features(lengths, work) for lengths, work in zip(ranks, works, strict=True)])
                for ranks, works in zip(step_rank_lengths, encoder, strict=True)]
    counts_vary = any(np.ptp(f[:, 2]) > 0 for f in features) or np.ptp([f[0, 2] for f in features]) > 0
    columns = [0, 1, 2] if counts_vary else [0, 1]
    vision = _vision_columns(np.concatenate(features))
    # The alternation finds a consistent choice of slowest ranks, not always the best one: start from each
    # feature's "largest rank" (token pairs, tokens, samples, patches...) and keep the fit that explains the times
    # best.
    fits = [_fit_slowest(features, y, columns + vision, feature) for feature in (0, 1, 2, *vision)]
    coefficients, overhead, _ = min(fits, key=lambda fit: fit[2])
    return CostModel(*coefficients.tolist()), overhead


def _fit_slowest(
    features: list[np.ndarray], y: np.ndarray, columns: list[int], start: int
) -> tuple[np.ndarray, float, float]:
    """Alternate "pick each step's slowest rank" and "fit on those ranks"; return coefficients, overhead and the
    relative residual of the step-time model with them."""
    slowest = np.array([int(np.argmax(f[:, start])) for f in features])
    coefficients = np.zeros(5)
    for _ in range(MAX_ROUNDS):
        x = np.stack([np.append(f[r, columns], 1.0) for f, r in zip(features, slowest, strict=True)])
        w = _relative_nnls(x, y)
        coefficients = np.zeros(5)
        coefficients[columns] = w[:-1]
        picks = np.array([int(np.argmax(f @ coefficients)) for f in features])
        if np.array_equal(picks, slowest):
            break
        slowest = picks
    predicted = np.array([np.max(f @ coefficients) for f in features]) + w[-1]
    return coefficients, float(w[-1]), float(np.sum((predicted / y - 1) ** 2))
