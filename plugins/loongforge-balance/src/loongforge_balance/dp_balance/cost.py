"""Predicted compute of a sample: ``a * len**2 + b * len + c``.

Why this shape: a transformer step over a sequence of ``len`` tokens costs attention (quadratic in ``len``),
the dense layers (linear) and a fixed per-sample part (kernel launches, the vision encoder's setup, padding to
a multiple). The three coefficients are all a balancer needs, and they can be measured (:mod:`.fit`) rather than
derived from the model's sizes, so the same code serves any model, device and kernel mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """``cost(len) = a * len**2 + b * len + c``; all coefficients are >= 0 (any unit, e.g. seconds)."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0 or not max(self.a, self.b, self.c) > 0:
            raise ValueError(f"cost coefficients must be >= 0 and not all zero, got a={self.a} b={self.b} c={self.c}")

    def costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """The cost of each sample (float64)."""
        n = np.asarray(lengths, dtype=np.float64)
        return (self.a * n + self.b) * n + self.c

    def as_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c}


def load_features(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[sum len**2, sum len, count]`` of one rank's samples: its load is this vector dot ``(a, b, c)``."""
    n = np.asarray(lengths, dtype=np.float64)
    return np.array([np.dot(n, n), n.sum(), float(n.size)])
