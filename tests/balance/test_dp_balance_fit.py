"""The cost fit recovers known (a, b, c) from noisy synthetic timings, per rank and from step (max) times.

Per-rank times carry one measurement per rank and step, so 8 warm-up steps of 32 ranks pin the coefficients
within 5% under 1% timing noise. A step time only shows the slowest rank, so it carries far less: that fit is
exact without noise and within 10% after 128 steps with 0.5% noise (``benchmarks/dp_balance.py`` sweeps both).
"""

from __future__ import annotations

import numpy as np
import pytest
from loongforge_balance.dp_balance import CostModel, fit_cost_model, fit_from_steps
from loongforge_balance.dp_balance.fit import nnls
from loongforge_balance.dp_balance.synthetic import vlm_lengths

#: Seconds: 4e-9 s per token pair, 1e-4 s per token, 20 ms per sample (the vision encoder's setup, padding).
TRUE = CostModel(a=4e-9, b=1e-4, c=2e-2)


def assert_recovered(model: CostModel, truth: CostModel = TRUE, rtol: float = 0.05) -> None:
    for name in ("a", "b", "c"):
        got, want = getattr(model, name), getattr(truth, name)
        assert abs(got - want) <= rtol * want, f"{name}: fitted {got:.4g}, true {want:.4g}"


def random_rank(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    """A rank's samples in a token-budget (dynamic) batch: a varying number of random samples."""
    return rng.choice(lengths, size=int(rng.integers(1, 12)))


@pytest.mark.parametrize("mix", ["vlm", "video"])
def test_per_rank_times_with_noise(mix):
    rng = np.random.default_rng(0)
    pool = vlm_lengths(2048, mix, seed=0)
    ranks = [random_rank(rng, pool) for _ in range(8 * 32)]
    times = [TRUE.costs(r).sum() * rng.normal(1, 0.01) for r in ranks]
    assert_recovered(fit_cost_model(ranks, times))


def synthetic_steps(seed: int, num_steps: int, noise: float, overhead: float = 0.05):
    rng = np.random.default_rng(seed)
    pool = vlm_lengths(2048, "vlm", seed=seed)
    steps, times = [], []
    for _ in range(num_steps):
        ranks = [random_rank(rng, pool) for _ in range(8)]
        steps.append(ranks)
        times.append((max(TRUE.costs(r).sum() for r in ranks) + overhead) * rng.normal(1, noise))
    return steps, times


def test_step_times_are_the_slowest_rank_plus_an_overhead():
    model, overhead = fit_from_steps(*synthetic_steps(1, 16, noise=0.0))
    assert_recovered(model, rtol=1e-6)
    assert overhead == pytest.approx(0.05, rel=1e-6)
    model, overhead = fit_from_steps(*synthetic_steps(1, 128, noise=0.005))
    assert_recovered(model, rtol=0.10)


def test_fixed_batch_sizes_attribute_the_constant_to_the_step():
    """With the same sample count on every rank, c and the step overhead are indistinguishable: c goes to 0."""
    rng = np.random.default_rng(2)
    pool = vlm_lengths(2048, "vlm", seed=2)
    steps = [[rng.choice(pool, size=4) for _ in range(8)] for _ in range(24)]
    times = [max(TRUE.costs(r).sum() for r in ranks) + 0.05 for ranks in steps]
    model, fitted_overhead = fit_from_steps(steps, times)
    assert model.c == 0.0
    assert_recovered(CostModel(model.a, model.b, TRUE.c), rtol=0.01)
    assert fitted_overhead == pytest.approx(0.05 + 4 * TRUE.c, rel=0.01)


def test_nnls_keeps_coefficients_non_negative():
    x = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]])
    y = np.array([0.0, 0.5, 2.0, 3.5])  # the unconstrained fit has a negative intercept
    w = nnls(x, y)
    assert w.min() >= 0 and w[1] == 0.0
    assert w[0] == pytest.approx(np.dot(x[:, 0], y) / np.dot(x[:, 0], x[:, 0]))


def test_too_few_or_bad_measurements_are_refused():
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([[1, 2]] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_cost_model([[1, 2]] * 4, [1.0, 0.0, 1.0, 1.0])
