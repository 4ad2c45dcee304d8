"""Predicted compute of a sample: ``a * len**2 + b * len + c + d * patches + e * patch_pairs``.

Why this shape: a transformer step over a sequence of ``len`` tokens costs attention (quadratic in ``len``),
the dense layers (linear) and a fixed per-sample part (kernel launches, padding to a multiple). A sample with images
or videos also runs a vision encoder, whose work the LLM length does not show: the encoder reads every patch (a
Qwen ViT sees ``merge**2 = 4`` patches per LLM token, so its dense layers cost ``d`` per patch) and attends within
blocks of patches (one image, or one frame group of a video: ``patch_pairs`` is the sum over blocks of the block's
length squared), so a long video costs far more than its LLM tokens say. The five coefficients are all a balancer
needs, and they can be measured (:mod:`.fit`) rather than derived from the model's sizes, so the same code serves
any model, device and kernel mix. A sample without an encoder (text) has ``patches = patch_pairs = 0``.

A data path gives the encoder's work of each sample as the field :data:`ENCODER_KEY`: an int64 tensor ``[2]``
holding ``(patches, patch_pairs)``; without that field every sample is text to the model (``d``, ``e`` unused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: The sample field with the encoder's work: ``[patches, sum over attention blocks of block_length**2]`` (int64).
ENCODER_KEY = "encoder_work"


@dataclass(frozen=True)
class CostModel:
    """``cost = a * len**2 + b * len + c + d * patches + e * patch_pairs``; all coefficients >= 0 (any unit, e.g.
    seconds). ``d`` and ``e`` default to 0: a model fitted on text alone, or pinned as ``{a, b, c}``."""

    a: float
    b: float
    c: float
    d: float = 0.0
    e: float = 0.0

    def __post_init__(self) -> None:
        values = self.as_dict()
        if min(values.values()) < 0 or not max(values.values()) > 0:
            raise ValueError("cost coefficients must be >= 0 and not all zero, got "
                             + " ".join(f"{name}={value}" for name, value in values.items()))

    def costs(self, lengths: Sequence[int] | np.ndarray, encoder: np.ndarray | None = None) -> np.ndarray:
        """The cost of each sample (float64); ``encoder`` is ``[samples, 2]`` (patches, patch pairs) or None."""
        n = np.asarray(lengths, dtype=np.float64)
        total = (self.a * n + self.b) * n + self.c
        if encoder is not None:
            total = total + np.asarray(encoder, dtype=np.float64).reshape(-1, 2) @ np.array([self.d, self.e])
        return total

    def as_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d, "e": self.e}


def load_features(lengths: Sequence[int] | np.ndarray, encoder: np.ndarray | None = None) -> np.ndarray:
    """``[sum len**2, sum len, count, sum patches, sum patch_pairs]`` of one rank's samples: its load is this
    vector dot ``(a, b, c, d, e)``. ``encoder`` is ``[samples, 2]`` or None (text: zeros)."""
    n = np.asarray(lengths, dtype=np.float64)
    vision = np.zeros(2) if encoder is None else np.asarray(encoder, dtype=np.float64).reshape(-1, 2).sum(axis=0)
    return np.array([np.dot(n, n), n.sum(), float(n.size), *vision])
