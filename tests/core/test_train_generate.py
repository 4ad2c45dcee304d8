"""Token choice in text generation: greedy is argmax; top-k never samples outside the k best."""

from __future__ import annotations

import torch
from loongforge.models.generate import _next_token, pick, uniform_draw


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert _next_token(logits, temperature=0.0, top_k=0, uniform=0.5) == 1


def test_top_k_samples_only_the_best_k_and_is_seeded():
    logits = torch.tensor([5.0, 4.9, -2.0, -2.0, -2.0])
    draws = [_next_token(logits, 1.0, 2, uniform_draw(torch.Generator().manual_seed(s))) for s in range(50)]
    assert set(draws) == {0, 1}
    again = [_next_token(logits, 1.0, 2, uniform_draw(torch.Generator().manual_seed(s))) for s in range(50)]
    assert draws == again


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities ~ [0.5, 0.3, 0.15, 0.05]: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8), never the rest
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = {_next_token(logits, 1.0, 0, uniform_draw(torch.Generator().manual_seed(s)), top_p=0.7) for s in range(200)}
    assert draws == {0, 1}
    draws = {_next_token(logits, 1.0, 0, uniform_draw(torch.Generator().manual_seed(s)), top_p=0.4) for s in range(50)}
    assert draws == {0}


def test_pick_is_the_inverse_cdf_and_never_a_zero_probability_id():
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25, 0.0])
    assert [pick(probs, u) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999999)] == [0, 0, 2, 2, 3, 3]
    assert pick(probs * 3, 0.5) == 2  # unnormalised weights pick the same
    assert pick(torch.tensor([0.0, 1.0, 0.0]), 1.0 - 1e-17) == 1  # a draw that rounds to the whole mass
