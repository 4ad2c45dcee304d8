"""The preference losses of ``training.phase: dpo``, from sequence log-probabilities: plain torch, no megatron.

Why separate from the engine: these few lines are what users compare against TRL and the papers, so they live where
a test can recompute them from any model's log-probs. The engine only turns the model's per-token loss into the
sequence log-probs they take (:func:`sequence_logps`).

With ``pi`` the policy's and ``ref`` the reference's log-probability of a response (summed over its tokens, or their
mean with length normalisation), ``c``/``r`` the chosen/rejected response of one pair and ``beta`` the inverse
temperature, every loss reads the margin

    ``z = (pi_c - pi_r) - (ref_c - ref_r)``     (the reference term is 0 without a reference)

- ``sigmoid`` (DPO, Rafailov et al. 2023; with conservative label smoothing ``eps``, cDPO):
  ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``;
- ``ipo`` (Azar et al. 2023): ``(z - 1 / (2 beta))^2``;
- ``hinge`` (SLiC, Zhao et al. 2023): ``max(0, 1 - beta z)``;
- ``simpo`` (Meng et al. 2024; no reference, length-normalised log-probs, target margin ``gamma``): the sigmoid loss
  of ``z - gamma / beta``, i.e. ``-log sigmoid(beta (pi_c - pi_r) - gamma)`` without smoothing.

The implicit rewards are ``beta (pi - ref)`` per response (``beta pi`` without a reference), as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Values of ``dpo.loss_type``.
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss (differentiable) and the chosen and rejected implicit rewards (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def accuracies(self) -> torch.Tensor:
        """1 where the chosen reward is higher, 0 where lower, 0.5 for a tie (every pair at step 0 with a
        reference: the policy is its reference), so that chance is 50%."""
        return (self.chosen_rewards > self.rejected_rewards).double() + 0.5 * (
            self.chosen_rewards == self.rejected_rewards).double()


def sequence_logps(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, *, average: bool) -> torch.Tensor:
    """Each row's log-probability of its response tokens from the model's per-token loss (``-log p`` of every label,
    ``[rows, seq]``; megatron's vocab-parallel cross-entropy computes it at any tensor-parallel size): the sum over
    the tokens ``loss_mask`` selects, or their mean when ``average`` (length normalisation).

    Summed in float64: a response's log-prob is a few hundred nats, where float32's spacing (3e-5 at 256) would move
    DPO's margins -- differences of two such sums -- by more than the tokens' own rounding."""
    mask = loss_mask.double()
    total = -(per_token_loss.double() * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                      reference_chosen: torch.Tensor | None, reference_rejected: torch.Tensor | None, *,
                      loss_type: str, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0) -> PairLosses:
    """The loss of each pair from sequence log-probs (see the module docstring); ``None`` references: none."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    margin = policy_chosen - policy_rejected
    chosen_rewards, rejected_rewards = policy_chosen.detach(), policy_rejected.detach()
    if reference_chosen is not None and reference_rejected is not None:
        margin = margin - (reference_chosen - reference_rejected)
        chosen_rewards = chosen_rewards - reference_chosen
        rejected_rewards = rejected_rewards - reference_rejected
    if loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:  # sigmoid, simpo
        logits = beta * (margin - gamma / beta if loss_type == "simpo" else margin)
        losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return PairLosses(losses, beta * chosen_rewards.detach(), beta * rejected_rewards.detach())
