"""Per-feature normalisation of states and actions, and its inverse for the actions a policy predicts.

Modes (LeRobot's names):

- ``mean_std``: ``(x - mean) / std``
- ``min_max``: ``[min, max] -> [-1, 1]``
- ``quantiles``: ``[q01, q99] -> [-1, 1]`` (Pi0.5), robust to a few extreme values
- ``identity``: unchanged

Works on numpy arrays and torch tensors alike (the stats are cast to the input's type, dtype and device),
so the same object normalises batches in the data pipeline and unnormalises predicted actions on device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

MODES = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantiles": ("q01", "q99"), "identity": ()}


class Normalizer:
    """Normalise the features named in ``modes`` with ``stats`` (``{feature: {"mean": ..., ...}}``).

    A dimension whose spread (std, or half the min..max / q01..q99 range) is below ``eps`` is constant: every
    value maps to 0 (never inf/NaN, even for values the stats never saw, as a simulator's fixed observation
    dimensions give) and 0 maps back to the constant. Other dimensions divide by ``spread + eps``.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, Any]], modes: Mapping[str, str], *, eps: float = 1e-8):
        self.modes = dict(modes)
        self.eps = eps
        self._params: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, mode in self.modes.items():
            if mode not in MODES:
                raise ValueError(f"normalisation mode '{mode}' for '{key}' is unknown; choose one of {list(MODES)}")
            if mode == "identity":
                continue
            if key not in stats:
                raise KeyError(f"no stats for '{key}' (stats cover: {sorted(stats)})")
            missing = [name for name in MODES[mode] if name not in stats[key]]
            if missing:
                raise KeyError(f"stats of '{key}' lack {missing} needed by mode '{mode}' (have {sorted(stats[key])})")
            self._params[key] = self._affine(mode, *(np.asarray(stats[key][n], np.float64) for n in MODES[mode]))

    def _affine(self, mode: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(shift, scale, live, unscale)``: ``normalised = (x - shift) / scale * live`` and
        ``x = normalised * unscale + shift``; ``live`` is 1 (0 for a constant dimension, whose scale is then 1
        and unscale 0), so other dimensions compute exactly ``(x - shift) / scale`` and ``y * scale + shift``."""
        shift, spread = (a, b) if mode == "mean_std" else ((a + b) / 2, (b - a) / 2)
        live = (spread >= self.eps).astype(np.float64)
        scale = np.where(live > 0, spread + self.eps, 1.0)
        return shift, scale, live, scale * live

    def normalize(self, key: str, x: Any) -> Any:
        if key not in self._params:
            return x
        shift, scale, live, _ = (_like(p, x) for p in self._params[key])
        return (x - shift) / scale * live

    def unnormalize(self, key: str, x: Any) -> Any:
        if key not in self._params:
            return x
        shift, _, _, unscale = (_like(p, x) for p in self._params[key])
        return x * unscale + shift

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``batch`` with every feature this normaliser knows normalised."""
        return {key: self.normalize(key, value) for key, value in batch.items()}

    def inverse(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {key: self.unnormalize(key, value) for key, value in batch.items()}


def _like(param: np.ndarray, x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return param.astype(x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64)
    import torch

    return torch.as_tensor(param, dtype=x.dtype, device=x.device)
