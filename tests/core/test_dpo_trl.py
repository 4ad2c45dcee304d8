"""Our preference losses equal TRL's own (trl 1.16) on the same per-token log-probs: the loss and its gradient with
respect to every policy token log-prob, and the logged rewards.

Why TRL: it is what users compare a DPO run with, and its code, not a paper, decides the details -- which losses
average token log-probs over the response, where label smoothing sits, the SimPO margin. Our side is what the engine
runs on the last pipeline stage: :class:`~loongforge.train.preference.objective.PreferenceObjective` of a ``dpo:``
section, on the per-token loss (``-log p``) of a micro-batch's rows (chosen pairs, then rejected) and the reference
pass's report. TRL's side:

- ``DPOTrainer._compute_loss`` (TRL 1.16 has no standalone DPO loss function), on a trainer made without its
  ``__init__`` with the attributes that method reads set by hand to literal values; the model is a stand-in for one
  patched by ``trl.trainer.utils.add_fused_lm_head``, returning the given log-probs (zero where the label is -100, as
  that head does), and the reference log-probs go in precomputed (``ref_chosen_logps``), as TRL's
  ``precompute_ref_log_probs`` feeds them. Its ``sigmoid``, ``sigmoid_norm`` (sigmoid on token-averaged log-ratios),
  ``ipo`` (token-averaged) and ``hinge`` are ours with our default normalisation, or ``length_normalization: true``
  for ``sigmoid_norm``.
- ``CPOTrainer.cpo_loss`` (``trl.experimental.cpo``) for ``simpo`` (on token-averaged log-probs, no reference) and for
  label smoothing, which TRL 1.16's DPO sigmoid no longer takes: CPO's smoothed sigmoid is the conservative DPO (cDPO)
  loss of whatever chosen/rejected scores it is given -- the policy's log-probs (our reference-free sigmoid), or the
  policy's log-ratios to the reference (our cDPO, as TRL's DPO computed it before 1.0).

Everything is float64, so the two sides differ by rounding only (measured <= 6e-17); the bound is 1e-10.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from loongforge.config.schema import DPOConfig
from loongforge.train.preference.objective import REFERENCE_LOGPS, REPORT, PreferenceObjective
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

with warnings.catch_warnings():  # trl.experimental announces itself as unstable on import
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOTrainer

PAIRS, SEQ = 6, 24
TOLERANCE = 1e-10
#: (TRL DPOTrainer loss_type, beta) -> our dpo: section
DPO_CASES = {
    ("sigmoid", 0.1): DPOConfig(loss_type="sigmoid", beta=0.1),
    ("sigmoid", 0.5): DPOConfig(loss_type="sigmoid", beta=0.5),
    ("sigmoid_norm", 0.5): DPOConfig(loss_type="sigmoid", beta=0.5, length_normalization=True),
    ("ipo", 0.1): DPOConfig(loss_type="ipo", beta=0.1),
    ("ipo", 2.0): DPOConfig(loss_type="ipo", beta=2.0),
    ("hinge", 0.1): DPOConfig(loss_type="hinge", beta=0.1),
    ("hinge", 2.0): DPOConfig(loss_type="hinge", beta=2.0),  # some pairs past the hinge, without gradient
}
#: (TRL CPOTrainer loss_type, beta, label_smoothing, simpo_gamma, whether CPO is given log-ratios to the reference)
#: -> our dpo: section
CPO_CASES = {
    ("simpo", 2.0, 0.0, 0.5, False): DPOConfig(loss_type="simpo", beta=2.0, gamma=0.5),
    ("simpo", 2.5, 0.1, 1.0, False): DPOConfig(loss_type="simpo", beta=2.5, gamma=1.0, label_smoothing=0.1),
    ("sigmoid", 0.1, 0.2, 0.0, True): DPOConfig(loss_type="sigmoid", beta=0.1, label_smoothing=0.2),
    ("sigmoid", 0.1, 0.3, 0.0, False): DPOConfig(loss_type="sigmoid", beta=0.1, label_smoothing=0.3, reference="none"),
}


@pytest.fixture(scope="module")
def pairs():
    """``PAIRS`` pairs as a micro-batch lays them out (chosen rows, then rejected): token ids, the completion mask
    (a prompt of 3-7 tokens shared by both rows of a pair, responses of 2-12 tokens, then padding), and the policy's
    and reference's per-token log-probs of each next token (``[rows, SEQ - 1]``)."""
    generator = torch.Generator().manual_seed(38)
    rows = 2 * PAIRS
    prompt = torch.randint(3, 8, (PAIRS,), generator=generator).repeat(2)
    response = torch.randint(2, 13, (rows,), generator=generator)
    position = torch.arange(SEQ)
    completion = ((position >= prompt[:, None]) & (position < (prompt + response)[:, None])).long()
    attention = (position < (prompt + response)[:, None]).long()
    ids = torch.randint(0, 256, (rows, SEQ), generator=generator)

    def logps():
        return -4 * torch.rand(rows, SEQ - 1, generator=generator, dtype=torch.float64)

    return SimpleNamespace(ids=ids, completion=completion, attention=attention, policy=logps(), reference=logps())


class FusedHead(torch.nn.Module):
    """Stands in for a causal LM patched by TRL's ``add_fused_lm_head``: called with ``fused_lm_head=True`` and
    labels, it returns the given per-token log-probs of the next-token labels, zero where the label is -100."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = log_probs

    def forward(self, input_ids, attention_mask, use_cache, labels, fused_lm_head):
        assert fused_lm_head and labels.shape == input_ids.shape
        mask = labels[:, 1:] != -100
        zeros = torch.zeros_like(self.log_probs)
        return FusedCausalLMOutput(log_probs=self.log_probs.masked_fill(~mask, 0), entropy=zeros, mean_logits=zeros,
                                   is_top1=torch.zeros_like(mask), label_mask=mask)


def _accelerator():
    """One process: gathers are the identity."""
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)


def _trl_dpo(loss_type, beta, pairs, policy):
    """TRL's DPO loss of the batch and the metrics it logged."""
    trainer = object.__new__(DPOTrainer)
    model = FusedHead(policy)
    attributes = dict(model=model, accelerator=_accelerator(), aux_loss_enabled=False, precompute_ref_logps=True,
                      ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
                      beta=beta, label_smoothing=0.0, use_weighting=False, _tp_size=1, _total_train_tokens=0,
                      _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    for name, value in attributes.items():
        setattr(trainer, name, value)
    shift_mask = pairs.completion[:, 1:]
    reference = (pairs.reference * shift_mask).sum(1)  # what TRL's precompute pass stores per sequence
    inputs = {"input_ids": pairs.ids, "attention_mask": pairs.attention, "completion_mask": pairs.completion,
              "ref_chosen_logps": reference[:PAIRS], "ref_rejected_logps": reference[PAIRS:]}
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


def _ours(options, pairs, policy):
    """The engine's loss of the micro-batch and its means (loss, ``dpo/*``)."""
    objective = PreferenceObjective.of(options)
    batch = {"loss_mask": pairs.completion[:, 1:]}
    if options.reference != "none" and options.loss_type != "simpo":
        _, report = objective.reference_report(batch["loss_mask"], -pairs.reference)
        batch[REFERENCE_LOGPS] = report[REFERENCE_LOGPS]
    loss, report = objective.loss(batch, -policy)
    return loss, PreferenceObjective.numbers(report[REPORT])


def _assert_same(ours, theirs, policy, pairs):
    """Equal losses, and equal gradients with respect to every policy token log-prob: real ones, on the response
    tokens only."""
    ours_grad, = torch.autograd.grad(ours, policy)
    theirs_grad, = torch.autograd.grad(theirs, policy)
    assert theirs.item() > 0.05 and abs(ours.item() - theirs.item()) <= TOLERANCE, (ours.item(), theirs.item())
    assert theirs_grad.abs().max() > 1e-3 and (theirs_grad[pairs.completion[:, 1:] == 0] == 0).all()
    assert (ours_grad - theirs_grad).abs().max() <= TOLERANCE


@pytest.mark.parametrize(("loss_type", "beta"), list(DPO_CASES))
def test_dpo_trainer_loss_gradient_and_rewards(pairs, loss_type, beta):
    policy = pairs.policy.clone().requires_grad_()
    theirs, metrics = _trl_dpo(loss_type, beta, pairs, policy)
    ours, numbers = _ours(DPO_CASES[loss_type, beta], pairs, policy)
    _assert_same(ours, theirs, policy, pairs)
    if loss_type in ("sigmoid", "hinge"):  # rewards of summed log-probs (TRL logs those whatever the loss averages)
        assert abs(numbers["dpo/chosen_reward"] - metrics["rewards/chosen"][0]) <= TOLERANCE
        assert abs(numbers["dpo/rejected_reward"] - metrics["rewards/rejected"][0]) <= TOLERANCE
        assert abs(numbers["dpo/reward_margin"] - metrics["rewards/margins"][0]) <= TOLERANCE
        assert abs(metrics["rewards/margins"][0]) > 1e-2


@pytest.mark.parametrize(("loss_type", "beta", "smoothing", "gamma", "log_ratios"), list(CPO_CASES))
def test_cpo_loss_simpo_and_label_smoothing(pairs, loss_type, beta, smoothing, gamma, log_ratios):
    policy = pairs.policy.clone().requires_grad_()
    mask = pairs.completion[:, 1:]
    scores = (policy * mask).sum(1)
    if loss_type == "simpo":
        scores = scores / mask.sum(1)  # CPO's average_log_prob for simpo
    if log_ratios:
        scores = scores - (pairs.reference * mask).sum(1)
    trainer = object.__new__(CPOTrainer)
    for name, value in dict(loss_type=loss_type, beta=beta, label_smoothing=smoothing, simpo_gamma=gamma, alpha=0.0,
                            accelerator=_accelerator()).items():
        setattr(trainer, name, value)
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(scores[:PAIRS], scores[PAIRS:])
    theirs = losses.mean()
    ours, numbers = _ours(CPO_CASES[loss_type, beta, smoothing, gamma, log_ratios], pairs, policy)
    _assert_same(ours, theirs, policy, pairs)
    assert abs(numbers["dpo/chosen_reward"] - chosen_rewards.mean().item()) <= TOLERANCE
    assert abs(numbers["dpo/rejected_reward"] - rejected_rewards.mean().item()) <= TOLERANCE
