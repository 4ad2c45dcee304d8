"""The megatron step engine for ``training.phase: grpo``: every step samples replies, scores them, and updates the
policy on them.

One step, on each data-parallel rank, for its ``num_microbatches`` micro-batches of ``micro_batch_size`` prompts:

1. **rollout** -- each prompt is sampled ``group_size`` times by the policy's own forward
   (:mod:`loongforge.train.rl.rollout`), each reply from a generator seeded by the run's seed, the prompt's position
   in the data stream and the reply's index (so a layout samples what one process samples); the replies are decoded
   and scored by their reward (:mod:`loongforge.train.rl.rewards`), and each group's rewards become advantages;
2. **reference** (``grpo.kl_coeff > 0``) -- a forward-only pass of megatron's schedule through the reference model
   gives each reply token's reference log-prob;
3. **recompute** -- a forward-only pass through the policy gives each token's log-prob as the trainer computes it
   (``old``): ``rl/logprob_diff_max`` is its largest difference from the sampler's, exactly 0 for the built-in
   sampler, and the importance-sampling correction reads it;
4. **updates** -- ``updates_per_step`` optimizer steps, each over an equal share of the micro-batches, through the
   objective of :mod:`loongforge.train.rl.objective` (with ``routing_replay``, every forward of steps 3-4 reuses the
   experts the rollout chose).

The three phases are timed (``time/rollout_s``, ``time/reference_s``, ``time/update_s``) and the step's rewards,
reply lengths and the objective's numbers are logged under ``rl/``; sampled replies go to ``rollouts.jsonl`` and the
trackers (:meth:`take_samples`). Evaluation decodes the held-out prompts greedily and reports the mean reward
(``val_reward``; ``val_loss`` is its negative). Nothing beyond the language-model engine's state is checkpointed:
the sampler's streams are functions of the data position, and the reference is rebuilt from the starting weights.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from loongforge.checkpoint.saver import unwrap_model
from loongforge.config.schema import GRPOConfig
from loongforge.data.prompt_dataset import PROMPT_INDEX, Prompt
from loongforge.errors import ConfigError
from loongforge.models.generate import supports_kv_cache
from loongforge.train.engines.megatron import MegatronEngine
from loongforge.train.rl.objective import (
    ADVANTAGES,
    OLD_LOGPS,
    REFERENCE_LOGPS,
    REPORT,
    ROLLOUT_LOGPS,
    SUMMED,
    TOKEN_SCALE,
    PolicyObjective,
    group_advantages,
)
from loongforge.train.rl.rewards import Reward, score
from loongforge.train.rl.rollout import (
    Replies,
    kv_cache_draft,
    reply_seed,
    reply_uniforms,
    sample_replies,
    sample_replies_cached,
)
from loongforge.train.rl.routing_replay import RoutingReplay

#: Sampled replies, one JSON line each, in the run's directory.
ROLLOUTS_FILE = "rollouts.jsonl"
#: The key a pass's loss function reports each row's per-token log-probs under.
_LOGPS = "logps"


class PolicyGradientEngine(MegatronEngine):
    """:class:`MegatronEngine` over prompts: ``objective`` is the loss, ``rewards`` maps reward names to rewards
    (``None``: the prompt's own), ``reference`` the KL term's model (``None``: no KL term), ``tokenizer`` decodes
    replies and ends them."""

    phase: ClassVar[str] = "grpo"
    loss_tracks_progress: ClassVar[bool] = False

    def __init__(self, *, objective: PolicyObjective, options: GRPOConfig, rewards: dict[str | None, Reward],
                 reference: Any, tokenizer: Any, **engine: Any) -> None:
        super().__init__(**engine)
        self.objective, self.options, self.reference = objective, options, reference
        self._rewards, self._tokenizer = rewards, tokenizer
        self.tokens_per_step = options.group_size * self.tokens_per_step  # every prompt's group of replies
        if self.num_microbatches % options.updates_per_step:
            raise ConfigError(f"{self.config.source}: grpo.updates_per_step {options.updates_per_step} must divide "
                              f"the step's {self.num_microbatches} micro-batches on each data-parallel rank")
        self._replay = RoutingReplay(self.model) if options.routing_replay else None
        #: The last step's sampled replies, for :meth:`take_samples`.
        self._samples: list[dict[str, Any]] = []

    @property
    def rows_per_micro_batch(self) -> int:
        return self.options.group_size * self.config.training.micro_batch_size

    # -- one step ---------------------------------------------------------------------------------------

    def train_step(self, screen: Any = None) -> Any:
        from loongforge.train.engines.base import StepResult

        started = time.perf_counter()
        micro_batches, rewards, lengths = [], [], []
        for _ in range(self.num_microbatches):
            batch, scored, replies = self._rollout_micro_batch()
            micro_batches.append(batch)
            rewards.append(scored)
            lengths += [float(len(ids)) for ids in replies.ids]
        rolled = time.perf_counter()
        if self.reference is not None:
            with self.reference.scoring(self.model) as chunks:
                self._attach(micro_batches, REFERENCE_LOGPS, chunks)
        referenced = time.perf_counter()
        self._attach(micro_batches, OLD_LOGPS)
        numbers = self._rollout_numbers(torch.cat(rewards), torch.tensor(lengths))
        per_update = self.num_microbatches // self.options.updates_per_step
        losses, grad_norm, update_successful = [], None, True
        for first in range(0, self.num_microbatches, per_update):
            group = micro_batches[first : first + per_update]
            self._scale_tokens(group)
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            with self._saving(), self._replaying():
                reduced = self._schedule(self._policy_step, self._feed(iter(group)), len(group), forward_only=False)
            update = self._update_numbers(reduced, len(group))
            losses.append(update.pop("loss"))
            numbers.update(update)
            bad = screen.screen(losses[-1], self._gradient_sum) if screen is not None else None
            if bad is not None:
                return StepResult(loss=losses[-1], grad_norm=None, skipped=True,
                                  extra={**numbers, **self._step_extra()}, bad=bad)
            update_successful, grad_norm, _ = self.optimizer.step()
        numbers.update({"time/rollout_s": rolled - started, "time/reference_s": referenced - rolled,
                        "time/update_s": time.perf_counter() - referenced})
        return StepResult(loss=sum(losses) / len(losses), grad_norm=grad_norm, skipped=not update_successful,
                          extra={**numbers, **self._step_extra()})

    def _rollout_micro_batch(self) -> tuple[dict[str, Any], torch.Tensor, Replies]:
        """The next micro-batch of prompts, each sampled ``group_size`` times and scored: the batch the passes read,
        the rewards and the replies."""
        group = self.options.group_size
        position = self.data.consumed_samples + self._dp_rank * self.config.training.micro_batch_size
        indices = next(self.data)[PROMPT_INDEX].tolist()
        prompts = [self.data.dataset[i] for i in indices for _ in range(group)]
        seeds = [reply_seed(self.config.run.seed, position + p, j) for p in range(len(indices)) for j in range(group)]
        replies = self._sample_replies(prompts, seeds)
        rewards = self._score(prompts, replies)
        batch = {**replies.batch(), ROLLOUT_LOGPS: replies.logps,
                 ADVANTAGES: group_advantages(rewards, group, scale=self.options.scale_advantages)}
        if self._replay is not None:  # one forward over the finished rows records every token's experts
            with self._forward_only():
                batch[RoutingReplay.KEY] = self._replay.recorded(
                    lambda: self._policy_forward(replies.tokens, replies.position_ids))
        self._keep_samples(prompts, replies, rewards)
        return batch, rewards, replies

    def _sample_replies(self, prompts: Sequence[Prompt], seeds: Sequence[int] | None) -> Replies:
        """Replies to ``prompts`` by the policy (``grpo.rollout``'s sampler; greedy without ``seeds``), in eval
        mode."""
        tokenizer = self._tokenizer
        shape = {"width": self.config.data.seq_length, "max_new_tokens": self.options.max_new_tokens,
                 "vocab_size": tokenizer.vocab_size, "stop_ids": (tokenizer.eos_id,), "pad_id": tokenizer.pad_id}
        ids = [p.ids for p in prompts]
        uniforms = None if seeds is None else reply_uniforms(seeds, self.options.max_new_tokens)
        model = unwrap_model(self.model[0])
        with self._forward_only():
            if self.options.rollout == "kv_cache":
                return sample_replies_cached(model, ids, uniforms=uniforms, **shape)
            # drafted by the KV cache where the model has one, every token verified by the trainer's forward
            draft = kv_cache_draft(model, tokenizer.vocab_size, shape["stop_ids"]) if supports_kv_cache(model) else None
            return sample_replies(self._policy_forward, self._token_loss, ids, uniforms=uniforms, draft=draft, **shape)

    def _policy_forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model[0](tokens, position_ids, None)

    def _token_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The model's own per-token loss of ``[rows, seq, vocab shard]`` logits: what its forward computes from
        labels (megatron's vocab-parallel cross-entropy on the ``[seq, rows]`` layout)."""
        return unwrap_model(self.model[0]).compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())

    def _score(self, prompts: Sequence[Prompt], replies: Replies) -> torch.Tensor:
        """Each reply's reward, by the config's reward or its prompt's own."""
        values = []
        for prompt, ids in zip(prompts, replies.ids, strict=True):
            name = self.options.reward or prompt.reward
            values.append(score(self._rewards[name], completion=self._tokenizer.decode(ids), answer=prompt.answer,
                                prompt=prompt.text, name=name, where=prompt.where))
        return torch.tensor(values, dtype=torch.float64)

    # -- the passes -------------------------------------------------------------------------------------

    def _attach(self, micro_batches: list[dict[str, Any]], key: str, chunks: list[Any] | None = None) -> None:
        """Each row's per-token log-probs under ``chunks`` (the policy by default) on its micro-batch as ``key``."""
        with self._replaying():
            reduced = self._forward_pass(self._scoring_step, micro_batches, chunks)
        for batch, report in zip(micro_batches, reduced, strict=True):
            batch[key] = report[_LOGPS]

    def _scoring_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        self._replay_batch(batch)
        return self._per_token_loss(batch, model), _token_logps

    def _policy_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        self._replay_batch(batch)
        return self._per_token_loss(batch, model), partial(self.objective.loss, batch)

    def _scale_tokens(self, micro_batches: list[dict[str, Any]]) -> None:
        """``token_mean``: the factor that makes each micro-batch's token sum its share of the update's mean over
        every reply token of every rank (megatron divides by the micro-batches, DDP averages over ranks)."""
        tokens = torch.stack([batch["loss_mask"].sum() for batch in micro_batches]).sum().double()
        if self._dp_size > 1:
            dist.all_reduce(tokens, group=self._dp_group)
        scale = len(micro_batches) * self._dp_size / max(tokens.item(), 1.0)
        for batch in micro_batches:
            batch[TOKEN_SCALE] = scale

    # -- routing replay ---------------------------------------------------------------------------------

    def _replaying(self) -> Any:
        return self._replay.replaying() if self._replay is not None else contextlib.nullcontext()

    def _replay_batch(self, batch: dict[str, Any]) -> None:
        if self._replay is not None:
            self._replay.target(batch[RoutingReplay.KEY])

    # -- numbers ----------------------------------------------------------------------------------------

    def _rollout_numbers(self, rewards: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
        """The step's rewards and reply lengths over every rank: means, the rewards' spread, the share of groups
        whose replies all scored alike (they teach nothing)."""
        group = self.options.group_size
        groups = rewards.reshape(-1, group)
        stats = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.double().sum(),
                             (groups.max(-1).values == groups.min(-1).values).double().sum(),
                             torch.tensor(float(rewards.numel()), dtype=torch.float64)])
        if self._dp_size > 1:
            dist.all_reduce(stats, group=self._dp_group)
        total, squares, length, uniform, count = stats.tolist()
        mean = total / count
        return {"rl/reward_mean": mean, "rl/reward_std": max(squares / count - mean * mean, 0.0) ** 0.5,
                "rl/reply_length": length / count, "rl/uniform_groups": uniform / (count / group)}

    def _update_numbers(self, reduced: list[dict], micro_batches: int) -> dict[str, float]:
        """One update's objective numbers over every rank (the schedule's reports, summed and maximised)."""
        reports = torch.stack([r[REPORT] for r in reduced])
        summed, maxima = reports[:, : len(SUMMED)].sum(0), reports[:, len(SUMMED) :].max(0).values
        if self._dp_size > 1:
            dist.all_reduce(summed, group=self._dp_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self._dp_group)
        return self.objective.numbers(summed, maxima, micro_batches * self._dp_size)

    # -- samples for the trackers -----------------------------------------------------------------------

    def _keep_samples(self, prompts: Sequence[Prompt], replies: Replies, rewards: torch.Tensor) -> None:
        wanted = self.options.log_samples - len(self._samples)
        for prompt, ids, reward in list(zip(prompts, replies.ids, rewards.tolist(), strict=True))[: max(wanted, 0)]:
            self._samples.append({"prompt": prompt.text, "reply": self._tokenizer.decode(ids), "answer": prompt.answer,
                                  "reward": reward})

    def log_records(self, trainer: Any, step: int) -> None:
        """Rank 0's replies kept since the last logging step (at most ``grpo.log_samples``): appended to
        ``rollouts.jsonl`` in the run's directory and shown as the trackers' ``rollouts`` table."""
        samples, self._samples = self._samples, []
        if trainer.rank != 0 or not samples:
            return
        with (trainer.output_dir / ROLLOUTS_FILE).open("a", encoding="utf-8") as out:
            out.writelines(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n" for sample in samples)
        columns = list(samples[0])
        trainer.media.table("rollouts", columns, [[sample[c] for c in columns] for sample in samples], step=step)

    # -- evaluation -------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy replies to this rank's held-out prompts, scored: the mean reward over every rank (``reward``),
        the share scoring above 0 (``solved``) and ``loss``, the negative mean reward."""
        rows = self._validation.rows
        totals = torch.zeros(3, dtype=torch.float64)
        for batch in self._validation_micro_batches():
            prompts = [rows[i] for i in batch[PROMPT_INDEX].tolist()]
            rewards = self._score(prompts, self._sample_replies(prompts, None))
            totals += torch.stack([rewards.sum(), (rewards > 0).double().sum(),
                                   torch.tensor(float(len(prompts)), dtype=torch.float64)])
        if self._dp_size > 1:
            dist.all_reduce(totals, group=self._dp_group)
        reward, solved, count = totals.tolist()
        return {"loss": -reward / count, "reward": reward / count, "solved": solved / count}


def _token_logps(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A scoring pass's loss function: each row's per-token log-probs, nothing to backpropagate."""
    return per_token_loss.new_zeros(()), {_LOGPS: (-per_token_loss).detach()}
