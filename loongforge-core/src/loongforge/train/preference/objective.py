"""One micro-batch of preference pairs -> the loss megatron's schedule backpropagates, and the step's metrics.

A micro-batch holds ``2m`` rows: the chosen sequences of ``m`` pairs, then their rejected ones
(:class:`~loongforge.data.contracts.PreferencePairs`). The model's per-token loss is ``-log p`` of every label --
megatron's vocab-parallel cross-entropy computes it at any tensor-parallel size from the vocabulary-split logits --
so a response's log-prob is minus its sum over the response mask, and the last pipeline stage has the whole pair.
The loss of a micro-batch is the mean over its pairs; megatron divides it by the number of micro-batches and its
DDP averages the gradients over data-parallel ranks, so the step's gradient is that of the mean over every pair of
the global batch, whatever the layout.

Each micro-batch also reports the sums of the pairs' losses, rewards, accuracies and policy log-probs and the pair
count; summed over micro-batches and ranks they give the step's means (:meth:`PreferenceObjective.numbers`), logged
as ``loss`` and ``dpo/<name>`` (TRL's ``rewards/*`` and ``logps/*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loongforge.config.schema import DPOConfig
from loongforge.train.preference.losses import preference_losses, sequence_logps
from loongforge.train.preference.settings import length_normalized

#: The batch key the reference log-probs of a micro-batch's rows travel under (``[2m]``, chosen first).
REFERENCE_LOGPS = "reference_logps"
#: The key of a micro-batch's report in what the schedule collects.
REPORT = "dpo"
#: What a report holds, in order (sums over the micro-batch's pairs, then the pair count).
REPORTED = ("loss", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/accuracy", "dpo/chosen_logp",
            "dpo/rejected_logp")


@dataclass(frozen=True)
class PreferenceObjective:
    """The ``dpo:`` section's loss (:mod:`loongforge.train.preference.losses`), with the length normalisation
    resolved."""

    loss_type: str
    beta: float
    label_smoothing: float
    gamma: float
    average: bool

    @classmethod
    def of(cls, options: DPOConfig) -> PreferenceObjective:
        return cls(options.loss_type, options.beta, options.label_smoothing, options.gamma, length_normalized(options))

    def logps(self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Each row's response log-prob (summed, or averaged over its tokens)."""
        return sequence_logps(per_token_loss, loss_mask, average=self.average)

    def loss(self, batch: dict[str, Any], per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The mean loss over the micro-batch's pairs and its report (the schedule's loss function)."""
        logps = self.logps(per_token_loss, batch["loss_mask"])
        pairs = logps.shape[0] // 2
        reference = batch.get(REFERENCE_LOGPS)
        result = preference_losses(
            logps[:pairs], logps[pairs:],
            None if reference is None else reference[:pairs], None if reference is None else reference[pairs:],
            loss_type=self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma)
        policy = logps.detach().double()
        report = torch.stack([result.losses.detach().double().sum(), result.chosen_rewards.double().sum(),
                              result.rejected_rewards.double().sum(), result.accuracies.sum(),
                              policy[:pairs].sum(), policy[pairs:].sum(),
                              torch.tensor(float(pairs), dtype=torch.float64)])
        return result.losses.mean(), {REPORT: report}

    def reference_report(self, loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The reference pass's loss function: the rows' log-probs, nothing to backpropagate."""
        return per_token_loss.new_zeros(()), {REFERENCE_LOGPS: self.logps(per_token_loss, loss_mask).detach()}

    @staticmethod
    def numbers(report: torch.Tensor) -> dict[str, float]:
        """Means over the pairs of summed reports: the loss, ``dpo/<name>`` and ``dpo/reward_margin``."""
        count = max(report[-1].item(), 1.0)
        means = {name: value / count for name, value in zip(REPORTED, report[:-1].tolist(), strict=True)}
        means["dpo/reward_margin"] = means["dpo/chosen_reward"] - means["dpo/rejected_reward"]
        return means

    @staticmethod
    def empty_report() -> torch.Tensor:
        """What a rank without the loss (an earlier pipeline stage) contributes to the sums."""
        return torch.zeros(len(REPORTED) + 1, dtype=torch.float64)
