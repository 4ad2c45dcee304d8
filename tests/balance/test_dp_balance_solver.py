"""The LPT plan: every sample placed once, near the lower bound, under the token cap, the same on every call."""

from __future__ import annotations

import numpy as np
import pytest
from loongforge_balance.dp_balance import CapacityError, CostModel, evaluate, lower_bound, lpt_plan
from loongforge_balance.dp_balance.synthetic import MIXES, vlm_lengths

#: Attention overtakes the dense layers at ~25k tokens (a 7B-like ratio); 50 token-equivalents per sample.
COST = CostModel(a=4e-5, b=1.0, c=50.0)


def sampler_order(num_samples: int, num_ranks: int) -> np.ndarray:
    """The unbalanced placement: consecutive equal slices of the shuffled stream, as the batch sampler gives."""
    return np.repeat(np.arange(num_ranks), num_samples // num_ranks)


@pytest.mark.parametrize("num_ranks", [8, 64, 512])
def test_vlm_mix_within_one_percent_of_the_lower_bound(num_ranks):
    lengths = vlm_lengths(4096, "vlm", seed=0)
    costs = COST.costs(lengths)
    plan = lpt_plan(costs, lengths, num_ranks)
    before = evaluate(sampler_order(4096, num_ranks), costs, lengths, num_ranks)
    # Every sample is on exactly one rank, and the reported loads are the loads of that placement.
    assert plan.ranks.shape == (4096,) and plan.ranks.min() >= 0 and plan.ranks.max() < num_ranks
    np.testing.assert_allclose(np.bincount(plan.ranks, weights=costs, minlength=num_ranks), plan.loads)
    assert plan.tokens.sum() == lengths.sum()
    assert plan.lower_bound == lower_bound(costs, num_ranks)
    assert plan.gap <= 1.01
    assert plan.max_load < before.max_load
    assert np.bincount(plan.ranks, minlength=num_ranks).min() >= 1  # no rank left idle


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_mix_gains_over_the_sampler(mix):
    lengths = vlm_lengths(1024, mix, seed=1)
    costs = COST.costs(lengths)
    plan = lpt_plan(costs, lengths, 64)
    before = evaluate(sampler_order(1024, 64), costs, lengths, 64)
    assert plan.gap <= 1.01 < before.gap


def test_oversized_video_is_scheduled_alone_and_sets_the_step_time():
    lengths = np.array([16000] + [500] * 63)
    costs = COST.costs(lengths)
    plan = lpt_plan(costs, lengths, 4)
    assert costs[0] > costs.sum() / 4  # alone it exceeds the ideal per-rank load
    video_rank = plan.ranks[0]
    assert np.count_nonzero(plan.ranks == video_rank) == 1  # nothing else waits on its rank
    assert plan.max_load == pytest.approx(costs[0]) and plan.gap == pytest.approx(1.0)
    others = np.delete(plan.loads, video_rank)
    assert others.max() - others.min() <= costs[1:].max()  # the rest balanced around it


def test_token_cap_is_respected_and_impossible_samples_are_named():
    lengths = vlm_lengths(256, "video", seed=2)
    costs = COST.costs(lengths)
    cap = int(lengths.sum() / 8 * 1.3)
    plan = lpt_plan(costs, lengths, 8, token_cap=cap)
    assert plan.tokens.max() <= cap and plan.gap <= 1.01
    with pytest.raises(CapacityError, match=r"sample \d+ has \d+ tokens, more than the per-rank token cap 3999"):
        lpt_plan(costs, lengths, 8, token_cap=3999)
    with pytest.raises(CapacityError, match="fits on no rank"):
        lpt_plan(COST.costs([10, 10, 10]), [10, 10, 10], 2, token_cap=10)


def test_plan_is_deterministic_with_ties():
    lengths = np.array([1000] * 37 + [200] * 11)
    costs = COST.costs(lengths)
    first, second = lpt_plan(costs, lengths, 5), lpt_plan(costs.copy(), lengths.copy(), 5)
    np.testing.assert_array_equal(first.ranks, second.ranks)
