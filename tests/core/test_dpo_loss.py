"""Every ``dpo.loss_type`` equals its formula, recomputed here from log-probs of a plain torch forward of the same tiny
model: the loss within 1e-6 and every parameter's gradient too; and on given log-probs the formulas agree to 1e-12
for any beta, smoothing and normalisation.

The engine's side is what a training step runs on the last stage: the pairs' rows as the shipped data lays them out
(chosen rows, then rejected), megatron's per-token cross-entropy turned into sequence log-probs, the reference's from
its own pass, and the objective's loss. The test's side reads the pairs' token ids itself, takes the logits of the
same model (no labels: no megatron loss), ``log_softmax`` in float64 and gathers each response token, then writes each
paper's formula out with its own expressions (``log(sigmoid)``, ``max``, squares) per pair. The model runs in float64;
megatron's cross-entropy computes in float32 whatever the logits' dtype, so a response's log-prob differs from the
float64 one by up to ~1.5e-6 (measured): the end-to-end cases use the betas people train with, where that moves the
loss by well under 1e-6, and :func:`test_formulas_on_given_log_probs` checks the formulas alone, exactly, everywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loongforge.config.schema import DataConfig, DPOConfig
from loongforge.data.preference_dataset import shipped_preference
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.models.decoder_model import build_model
from loongforge.models.llama import FLAVORS
from loongforge.train.preference.objective import REFERENCE_LOGPS, REPORT, PreferenceObjective

SEQ, PAIRS = 128, 4
#: (dpo options, whether the reference model takes part)
CASES = {
    "sigmoid": (DPOConfig(loss_type="sigmoid", beta=0.1), True),
    "sigmoid-cdpo": (DPOConfig(loss_type="sigmoid", beta=0.1, label_smoothing=0.2), True),
    "sigmoid-mean": (DPOConfig(loss_type="sigmoid", beta=0.5, length_normalization=True), True),
    "sigmoid-reference-free": (DPOConfig(loss_type="sigmoid", beta=0.1, reference="none"), False),
    "ipo": (DPOConfig(loss_type="ipo", beta=0.1), True),
    "hinge": (DPOConfig(loss_type="hinge", beta=0.1), True),
    "simpo": (DPOConfig(loss_type="simpo", beta=2.0, gamma=0.5), False),
    "simpo-smoothed": (DPOConfig(loss_type="simpo", beta=2.5, gamma=1.0, label_smoothing=0.1), False),
}


def _model(backend, seed):
    """llama-debug in float64, so that both sides agree to far below 1e-6 and the bound tests the formulas (in fp32
    the response log-probs themselves differ by ~1e-6 between two ways of rounding them)."""
    torch.manual_seed(seed)
    return build_model(FLAVORS["llama-debug"], backend=backend).double()


@pytest.fixture(scope="module")
def setup(megatron_cpu_world):
    """The policy, a reference with other weights (so the reference terms are not the policy's), the shipped pairs
    and their micro-batch as the data path lays it out."""
    dataset = shipped_preference([], ByteTokenizer())
    rows, _ = dataset.split_samples(DataConfig(seq_length=SEQ))
    picked = np.array([0, 3, 7, 10])  # strings and the chat-messages form (every fourth pair)
    return _model(megatron_cpu_world, 1), _model(megatron_cpu_world, 2), dataset, picked, rows.batch(picked)


def _response_logps(model, sample, average):
    """One conversation's response log-prob from the model's logits: ``log_softmax`` (float64), the label of each
    position, summed (or averaged) over the response tokens -- read from the sample, not from the batch."""
    ids = torch.as_tensor(sample.ids[: SEQ + 1])
    targets = torch.as_tensor(sample.supervised[1 : SEQ + 1])
    logits = model(ids[:-1].unsqueeze(0), torch.arange(len(ids) - 1).unsqueeze(0), None)[0]
    token_logps = torch.log_softmax(logits.double(), -1).gather(-1, ids[1:].unsqueeze(-1))[:, 0][targets]
    return token_logps.mean() if average else token_logps.sum()


def _formula(options, pc, pr, rc, rr):
    """The paper's loss of one pair (``rc``/``rr`` zero without a reference), written out independently."""
    beta, eps = options.beta, options.label_smoothing
    z = (pc - pr) - (rc - rr)
    if options.loss_type == "ipo":
        return (z - 1.0 / (2.0 * beta)) ** 2
    if options.loss_type == "hinge":
        return torch.clamp(1.0 - beta * z, min=0.0)
    if options.loss_type == "simpo":
        u = beta * (pc - pr) - options.gamma
    else:
        u = beta * z
    return -(1.0 - eps) * torch.log(torch.sigmoid(u)) - eps * torch.log(torch.sigmoid(-u))


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_the_formula(setup, case):
    policy, reference, dataset, picked, batch = setup
    options, with_reference = CASES[case]
    objective = PreferenceObjective.of(options)
    params = [p for p in policy.parameters() if p.requires_grad]

    # The engine's side: the reference pass's log-probs on the micro-batch, then the policy's loss on it.
    ours_batch = dict(batch)
    if with_reference:
        with torch.no_grad():
            per_token = reference(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        _, report = objective.reference_report(batch["loss_mask"], per_token)
        ours_batch[REFERENCE_LOGPS] = report[REFERENCE_LOGPS]
    per_token = policy(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    ours, numbers = objective.loss(ours_batch, per_token)
    ours_grads = torch.autograd.grad(ours, params)

    # The test's side, pair by pair from the tokenized samples.
    average = objective.average
    losses, rewards = [], []
    for index in picked:
        pair = dataset.pairs[index]
        pc, pr = (_response_logps(policy, side, average) for side in (pair.chosen, pair.rejected))
        rc = rr = torch.zeros((), dtype=torch.float64)
        if with_reference:
            with torch.no_grad():
                rc, rr = (_response_logps(reference, side, average) for side in (pair.chosen, pair.rejected))
        losses.append(_formula(options, pc, pr, rc, rr))
        rewards.append((options.beta * (pc - rc).item(), options.beta * (pr - rr).item()))
    expected = torch.stack(losses).mean()
    expected_grads = torch.autograd.grad(expected, params)

    assert abs(ours.item() - expected.item()) <= 1e-6, (ours.item(), expected.item())
    worst = max((a.double() - b).abs().max().item() for a, b in zip(ours_grads, expected_grads, strict=True))
    scale = max(b.abs().max().item() for b in expected_grads)
    assert scale > 1e-3 and worst <= 1e-6, (worst, scale)  # real gradients, equal to 1e-6
    # The report the metrics come from: the rewards and the accuracy of these pairs.
    sums = report_sums(numbers[REPORT])
    assert sums["pairs"] == len(picked)
    assert math.isclose(sums["chosen_reward"], sum(c for c, _ in rewards), abs_tol=1e-5)
    assert math.isclose(sums["rejected_reward"], sum(r for _, r in rewards), abs_tol=1e-5)
    assert sums["accuracy"] == sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in rewards)


def report_sums(report):
    loss, chosen, rejected, accuracy, _, _, pairs = report.tolist()
    return {"loss": loss, "chosen_reward": chosen, "rejected_reward": rejected, "accuracy": accuracy, "pairs": pairs}


def test_a_tie_counts_half_and_the_reference_cancels_at_the_start(setup):
    """Policy = reference (the first step of every run with a reference): each pair's margin is exactly 0, the
    sigmoid loss ln 2, the rewards 0 and the accuracy 50%."""
    policy, _, _, _, batch = setup
    objective = PreferenceObjective.of(DPOConfig())
    with torch.no_grad():
        per_token = policy(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        _, report = objective.reference_report(batch["loss_mask"], per_token)
        loss, numbers = objective.loss({**batch, REFERENCE_LOGPS: report[REFERENCE_LOGPS]}, per_token)
    means = PreferenceObjective.numbers(numbers[REPORT])
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert means["dpo/accuracy"] == 0.5 and means["dpo/reward_margin"] == 0.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "simpo"])
@pytest.mark.parametrize(("beta", "smoothing", "gamma"), [(0.1, 0.0, 0.5), (2.5, 0.3, 1.5)])
def test_formulas_on_given_log_probs(loss_type, beta, smoothing, gamma):
    """The losses and their gradients with respect to the four log-probs, on random summed-scale log-probs (float64),
    against the formulas above; the rewards are beta times the policy's gain over the reference."""
    from loongforge.train.preference.losses import preference_losses

    generator = torch.Generator().manual_seed(7)
    logps = [(-200 * torch.rand(16, generator=generator, dtype=torch.float64)).requires_grad_() for _ in range(4)]
    smoothing = smoothing if loss_type in ("sigmoid", "simpo") else 0.0
    options = DPOConfig(loss_type=loss_type, beta=beta, label_smoothing=smoothing, gamma=gamma)
    pc, pr, rc, rr = logps
    references = (None, None) if loss_type == "simpo" else (rc, rr)
    ours = preference_losses(pc, pr, *references, loss_type=loss_type, beta=beta, label_smoothing=smoothing,
                             gamma=gamma)
    zero = torch.zeros(16, dtype=torch.float64)
    expected = _formula(options, pc, pr, *((zero, zero) if loss_type == "simpo" else (rc, rr)))
    assert torch.allclose(ours.losses, expected, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours.losses.sum(), logps, allow_unused=True),
                    torch.autograd.grad(expected.sum(), logps, allow_unused=True), strict=True):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=1e-12)
    gain_c, gain_r = (pc, pr) if loss_type == "simpo" else (pc - rc, pr - rr)
    assert torch.allclose(ours.chosen_rewards, beta * gain_c.detach(), atol=1e-12)
    assert torch.allclose(ours.rejected_rewards, beta * gain_r.detach(), atol=1e-12)
