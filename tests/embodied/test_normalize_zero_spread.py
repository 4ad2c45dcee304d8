"""A state dimension with no spread in the training data (a simulator's fixed observation slots) normalises to 0
in every mode -- also for values the stats never saw -- and back to its constant; other dimensions are unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge_embodied.data.normalize import Normalizer
from loongforge_embodied.data.stats import compute_stats

VALUES = np.array([[0.0, 0.1], [2.0, 0.1], [4.0, 0.1], [1.0, 0.1]])  # column 1: constant 0.1 (inexact in binary)


@pytest.mark.parametrize("mode", ["mean_std", "min_max", "quantiles"])
def test_constant_dimension_maps_to_zero_and_back(mode):
    norm = Normalizer({"x": compute_stats(VALUES)}, {"x": mode})
    unseen = np.array([[1.0, 0.1 + 1e-7], [3.0, -5.0]])
    out = norm.normalize("x", unseen)
    assert np.isfinite(out).all() and (out[:, 1] == 0).all()
    np.testing.assert_array_equal(norm.unnormalize("x", out)[:, 1], np.full(2, compute_stats(VALUES)["mean"][1]))
    as_tensor = norm.normalize("x", torch.tensor(unseen, dtype=torch.float32))
    assert torch.isfinite(as_tensor).all() and (as_tensor[:, 1] == 0).all()
    np.testing.assert_allclose(norm.unnormalize("x", norm.normalize("x", VALUES))[:, 0], VALUES[:, 0], atol=1e-12)


def test_live_dimensions_keep_the_plain_formula():
    stats = compute_stats(VALUES)
    out = Normalizer({"x": stats}, {"x": "mean_std"}).normalize("x", VALUES)
    np.testing.assert_array_equal(out[:, 0], (VALUES[:, 0] - stats["mean"][0]) / (stats["std"][0] + 1e-8))
