"""Token choice in text generation: greedy is argmax; top-k never samples outside the k best."""

from __future__ import annotations

import torch
from loongforge.models.generate import _next_token


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert _next_token(logits, temperature=0.0, top_k=0, generator=torch.Generator().manual_seed(0)) == 1


def test_top_k_samples_only_the_best_k_and_is_seeded():
    logits = torch.tensor([5.0, 4.9, -2.0, -2.0, -2.0])
    draws = [_next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) == {0, 1}
    again = [_next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(50)]
    assert draws == again


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities ~ [0.5, 0.3, 0.15, 0.05]: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8), never the rest
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = {_next_token(logits, 1.0, 0, torch.Generator().manual_seed(s), top_p=0.7) for s in range(200)}
    assert draws == {0, 1}
    assert {_next_token(logits, 1.0, 0, torch.Generator().manual_seed(s), top_p=0.4) for s in range(50)} == {0}
