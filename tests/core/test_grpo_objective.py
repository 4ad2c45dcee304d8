"""GRPO's objective against its formulas written out here per token with plain Python floats: group-normalised
advantages (GRPO) and centred ones (Dr. GRPO), the clipped ratio (clip-higher included), truncated importance
sampling, the k3 KL estimator and the three aggregations -- the loss to 1e-12 and its gradient w.r.t. every token's
log-prob to 1e-12 (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from loongforge.train.rl.objective import (
    ADVANTAGES,
    OLD_LOGPS,
    REFERENCE_LOGPS,
    REPORT,
    ROLLOUT_LOGPS,
    TOKEN_SCALE,
    PolicyObjective,
    group_advantages,
)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    scaled = group_advantages(rewards, 4, scale=True)
    std = math.sqrt(sum((r - 0.5) ** 2 for r in (1, 0, 0, 1)) / 3)  # unbiased, as the GRPO paper's
    assert scaled[:4].tolist() == pytest.approx([c / (std + 1e-6) for c in (0.5, -0.5, -0.5, 0.5)], abs=1e-12)
    assert scaled[4:].tolist() == [0.0] * 4  # a group that scored alike teaches nothing
    assert group_advantages(rewards, 4, scale=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def _token_loss(logp, old, rollout, ref, advantage, options):
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - options.clip_low), 1 + options.clip_high)
    loss = max(-advantage * ratio, -advantage * clipped) * min(math.exp(old - rollout), options.correction_cap)
    if options.kl_coeff:
        loss += options.kl_coeff * (math.exp(ref - logp) - (ref - logp) - 1)
    return loss


CASES = {
    "grpo-token-mean": PolicyObjective(0.2, 0.2, 0.0, "token_mean", 6, 2.0),
    "clip-higher-kl": PolicyObjective(0.2, 0.28, 0.05, "token_mean", 6, 2.0),
    "sequence-mean": PolicyObjective(0.1, 0.3, 0.1, "sequence_mean", 6, 1.5),
    "dr-grpo": PolicyObjective(0.2, 0.2, 0.0, "sequence_sum_norm", 6, 3.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_the_formula(case):
    options = CASES[case]
    generator = torch.Generator().manual_seed(7)
    rows, seq = 4, 6
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]],
                        dtype=torch.float64)
    old = -torch.rand(rows, seq, generator=generator, dtype=torch.float64) * 3
    logps = (old + 0.4 * torch.randn(rows, seq, generator=generator, dtype=torch.float64)).requires_grad_()
    rollout = old + 0.8 * torch.randn(rows, seq, generator=generator, dtype=torch.float64)  # an inexact sampler
    ref = old + 0.3 * torch.randn(rows, seq, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.3, -0.7, 0.2, -1.1], dtype=torch.float64)
    tokens = int(mask.sum())
    batch = {"loss_mask": mask, OLD_LOGPS: old, ROLLOUT_LOGPS: rollout, REFERENCE_LOGPS: ref, ADVANTAGES: advantages,
             TOKEN_SCALE: 3 * 2 / 40}  # e.g. 3 micro-batches x 2 ranks, 40 reply tokens in the update
    loss, report = options.loss(batch, -logps)
    loss.backward()

    per_token = [[_token_loss(logps[r, t].item(), old[r, t].item(), rollout[r, t].item(), ref[r, t].item(),
                              advantages[r].item(), options) if mask[r, t] else 0.0 for t in range(seq)]
                 for r in range(rows)]
    if options.aggregation == "token_mean":
        expected = sum(map(sum, per_token)) * batch[TOKEN_SCALE]
    elif options.aggregation == "sequence_mean":
        expected = sum(sum(row) / mask[r].sum().item() for r, row in enumerate(per_token)) / rows
    else:
        expected = sum(map(sum, per_token)) / (rows * options.max_new_tokens)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)

    step = 1e-6  # the gradient by central differences of the written-out formula
    for r in range(rows):
        for t in range(seq):
            if not mask[r, t]:
                assert logps.grad[r, t] == 0.0
                continue
            up, down = (_token_loss(logps[r, t].item() + d, old[r, t].item(), rollout[r, t].item(), ref[r, t].item(),
                                    advantages[r].item(), options) for d in (step, -step))
            weight = (batch[TOKEN_SCALE] if options.aggregation == "token_mean"
                      else 1 / (rows * mask[r].sum().item()) if options.aggregation == "sequence_mean"
                      else 1 / (rows * options.max_new_tokens))
            assert logps.grad[r, t].item() == pytest.approx(weight * (up - down) / (2 * step), rel=1e-6, abs=1e-9)

    summed = report[REPORT]
    assert summed[4].item() == tokens
    ratios = [math.exp(logps[r, t].item() - old[r, t].item()) for r in range(rows) for t in range(seq) if mask[r, t]]
    assert summed[3].item() == pytest.approx(sum(ratios), rel=1e-12) and summed[5].item() == max(ratios)
    diffs = [abs(old[r, t].item() - rollout[r, t].item()) for r in range(rows) for t in range(seq) if mask[r, t]]
    assert summed[6].item() == max(diffs)


def test_an_exact_sampler_on_policy_gives_the_plain_policy_gradient():
    """On policy (logp == old == rollout) the loss is -A per token and its gradient -A x weight: REINFORCE with a
    group baseline, nothing clipped, no correction."""
    options = CASES["grpo-token-mean"]
    logps = torch.full((2, 3), -1.5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.float64)
    batch = {"loss_mask": mask, OLD_LOGPS: logps.detach().clone(), ROLLOUT_LOGPS: logps.detach().clone(),
             ADVANTAGES: torch.tensor([2.0, -1.0], dtype=torch.float64), TOKEN_SCALE: 1 / 6}
    loss, report = options.loss(batch, -logps)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 * 3 + 1.0 * 3) / 6, abs=1e-15)
    assert logps.grad.tolist() == [[-2 / 6] * 3, [1 / 6] * 3]
    assert report[REPORT][2].item() == 0 and report[REPORT][6].item() == 0  # nothing clipped, no sampler mismatch
