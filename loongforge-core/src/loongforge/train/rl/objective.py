"""GRPO's objective: group-normalised advantages, and the clipped policy loss of one micro-batch of replies.

With ``pi`` the policy's log-prob of a reply token (the trainer's per-token cross-entropy, negated), ``old`` the
policy's at the start of the step (the recompute pass), ``rollout`` the sampler's, ``A`` the reply's advantage and
``r = exp(pi - old)``, each reply token's loss is

    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * min(exp(old - rollout), cap) + kl_coeff * k3``

where the middle factor is truncated importance sampling (exactly 1 when the sampler computed what the trainer
computes) and ``k3 = exp(ref - pi) - (ref - pi) - 1`` the non-negative KL estimator against the reference model.
``grpo.loss_aggregation`` turns the token losses into the micro-batch's loss so that, after megatron divides by the
number of micro-batches and averages the gradients over data-parallel ranks, the step's loss is the chosen mean over
every reply of the update, whatever the layout:

- ``token_mean``: sum over the micro-batch's reply tokens x (micro-batches x dp ranks) / reply tokens of the update;
- ``sequence_mean``: the mean over the micro-batch's replies of each reply's token mean;
- ``sequence_sum_norm``: sum over the micro-batch's reply tokens / (replies x ``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loongforge.config.schema import GRPOConfig

#: Batch keys of a micro-batch of replies beside the language-model ones.
ADVANTAGES, ROLLOUT_LOGPS, OLD_LOGPS, REFERENCE_LOGPS = "advantages", "rollout_logps", "old_logps", "reference_logps"
#: The batch key of the factor ``token_mean`` multiplies a micro-batch's token sum by.
TOKEN_SCALE = "token_scale"
#: The key of a micro-batch's report in what the schedule collects.
REPORT = "grpo"
#: What a report sums, in order (then the maxima of :data:`MAXIMA`).
SUMMED = ("loss", "rl/kl", "rl/clip_fraction", "rl/ratio_mean", "tokens")
MAXIMA = ("rl/ratio_max", "rl/logprob_diff_max")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool) -> torch.Tensor:
    """Each reply's reward minus its group's mean (a group: ``group_size`` consecutive replies of one prompt),
    divided by the group's standard deviation (unbiased, plus 1e-6) when ``scale``; float64."""
    groups = rewards.double().reshape(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale:
        centred = centred / (groups.std(-1, keepdim=True) + 1e-6)
    return centred.reshape(-1)


@dataclass(frozen=True)
class PolicyObjective:
    """The ``grpo:`` section's loss."""

    clip_low: float
    clip_high: float
    kl_coeff: float
    aggregation: str
    max_new_tokens: int
    correction_cap: float

    @classmethod
    def of(cls, options: GRPOConfig) -> PolicyObjective:
        return cls(options.clip_low, options.clip_high, options.kl_coeff, options.loss_aggregation,
                   options.max_new_tokens, options.rollout_correction_cap)

    def token_losses(self, batch: dict[str, Any], logps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Per reply token: the loss (differentiable, ``[rows, seq]``) and its parts for the report."""
        old, rollout = batch[OLD_LOGPS], batch[ROLLOUT_LOGPS]
        advantages = batch[ADVANTAGES].to(logps.dtype).unsqueeze(-1)
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.clip_low, 1 + self.clip_high)
        policy = torch.maximum(-advantages * ratio, -advantages * clipped)
        correction = torch.clamp(torch.exp(old - rollout), max=self.correction_cap)
        losses = policy * correction
        kl = torch.zeros_like(logps)
        if self.kl_coeff:
            delta = batch[REFERENCE_LOGPS] - logps
            kl = torch.exp(delta) - delta - 1
            losses = losses + self.kl_coeff * kl
        parts = {"kl": kl.detach(), "ratio": ratio.detach(),
                 "clipped": (-advantages * clipped > -advantages * ratio).detach()}
        return losses, parts

    def aggregate(self, losses: torch.Tensor, mask: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's loss (see the module docstring)."""
        summed = losses * mask
        if self.aggregation == "token_mean":
            return summed.sum() * batch[TOKEN_SCALE]
        if self.aggregation == "sequence_mean":
            return (summed.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        return summed.sum() / (mask.shape[0] * self.max_new_tokens)

    def loss(self, batch: dict[str, Any], per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The schedule's loss function: the micro-batch's loss and its report."""
        mask = batch["loss_mask"].to(per_token_loss.dtype)
        logps = -per_token_loss
        losses, parts = self.token_losses(batch, logps)
        loss = self.aggregate(losses, mask, batch)
        on = mask.bool()
        tokens = on.sum().double()
        diff = (batch[OLD_LOGPS] - batch[ROLLOUT_LOGPS]).abs()[on]
        report = torch.stack([
            loss.detach().double(), parts["kl"][on].double().sum(), parts["clipped"][on].double().sum(),
            parts["ratio"][on].double().sum(), tokens,
            parts["ratio"][on].double().max() if tokens else tokens.new_zeros(()),
            diff.double().max() if tokens else tokens.new_zeros(()),
        ])
        return loss, {REPORT: report}

    @staticmethod
    def numbers(summed: torch.Tensor, maxima: torch.Tensor, micro_batches: int) -> dict[str, float]:
        """The update's numbers from its reports summed (and maximised) over micro-batches and ranks:
        ``loss`` (the mean of the micro-batches' losses: the objective), and per reply token ``rl/kl``,
        ``rl/clip_fraction``, ``rl/ratio_mean``, with the maxima."""
        loss, kl, clipped, ratio, tokens = summed.tolist()
        tokens = max(tokens, 1.0)
        return {"loss": loss / micro_batches, "rl/kl": kl / tokens, "rl/clip_fraction": clipped / tokens,
                "rl/ratio_mean": ratio / tokens, "rl/ratio_max": maxima[0].item(),
                "rl/logprob_diff_max": maxima[1].item()}
