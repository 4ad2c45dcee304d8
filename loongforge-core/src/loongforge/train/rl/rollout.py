"""Sampling replies with the trainer's own forward, so that the log-prob of every sampled token is, bit for bit, what
the training step recomputes.

Why not the KV-cache generator (:mod:`loongforge.models.generate`): a cached decoding step multiplies one new token
at a time, and floating-point sums come out differently for other matrix shapes (on the CPU a matrix product of a few
rows takes another kernel than one of many; a softmax over 11 keys another order than over 48), so its log-probs
differ from the trainer's in the last bits -- the mismatch RL trainers report between their rollout engine and their
trainer, which biases the importance ratio. Here every decoding step runs the policy on the whole ``[rows,
seq_length]`` batch the training step will run, with the not-yet-sampled positions holding padding: causal attention
gives those positions exactly zero weight, so the logits of every sampled position are those the training forward
computes from the finished rows, and the log-prob is taken from them by the model's own loss function (megatron's
vocab-parallel cross-entropy, at any tensor-parallel size). The cost is one full forward per new token instead of one
token's, which is what exactness costs; the replies are short in RL with verifiable rewards.

Sampling is from the policy itself (temperature 1, no top-k/top-p: the importance ratio and the KL term are about that
distribution), over the tokenizer's ids (megatron pads the vocabulary; the padded rows are never chosen). Each reply
draws from its own generator, so what it samples does not depend on the rows batched with it; ``generators=None``
decodes greedily (evaluation). Every tensor-parallel rank samples the same tokens: the gathered logits and the
generators are the same on all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loongforge.models.generate import gather_vocab


@dataclass
class Replies:
    """A batch of prompts with their sampled replies, laid out as the training step reads them: ``tokens``,
    ``labels`` (shifted by one), ``loss_mask`` (the replies' tokens, end-of-text included) and ``position_ids``, all
    ``[rows, seq_length]``; ``logps`` the sampler's log-prob of each label (0 outside the mask); ``ids`` each reply's
    ids without its end-of-text, and whether it ``ended`` there (else it ran out of tokens or room)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    logps: torch.Tensor
    ids: list[list[int]]
    ended: list[bool]

    def batch(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask,
                "position_ids": self.position_ids}


def reply_seed(seed: int, position: int, reply: int) -> int:
    """The seed of one reply's generator: a function of the run's seed, the prompt's position in the data stream
    (unique per step and prompt, the same whatever the data-parallel layout) and the reply's index in its group."""
    return int(np.random.SeedSequence([seed, position, reply]).generate_state(1, dtype=np.uint64)[0] >> 1)


@torch.no_grad()
def sample_replies(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[np.ndarray],
    *,
    width: int,
    max_new_tokens: int,
    vocab_size: int,
    stop_ids: Collection[int],
    pad_id: int,
    generators: Sequence[torch.Generator] | None,
) -> Replies:
    """Extend each prompt by up to ``max_new_tokens`` sampled ids (see the module docstring).

    ``forward(tokens, position_ids)`` is the policy's logits ``[rows, width, vocab shard]``; ``token_loss(labels,
    logits)`` the model's per-token loss of them (``[rows, width]``, ``-log p``). A reply stops after one of
    ``stop_ids`` (kept: the model learns to stop) or when its row is full (``width + 1`` ids: inputs and labels)."""
    rows = len(prompts)
    ids = torch.full((rows, width + 1), pad_id, dtype=torch.long)
    lengths = [len(prompt) for prompt in prompts]
    for row, prompt in enumerate(prompts):
        ids[row, : lengths[row]] = torch.as_tensor(prompt, dtype=torch.long)
    starts = list(lengths)
    positions = torch.arange(width).unsqueeze(0).expand(rows, width)
    logps = torch.zeros(rows, width)
    live = [length <= width for length in lengths]
    for _ in range(max_new_tokens):
        writing = [row for row in range(rows) if live[row]]
        if not writing:
            break
        logits = forward(ids[:, :width], positions)
        at = torch.as_tensor([lengths[row] - 1 for row in writing])
        picked = torch.as_tensor(writing)
        last = gather_vocab(logits[picked, at])[:, :vocab_size].float()
        if generators is None:
            chosen = last.argmax(-1).tolist()
        else:
            probs = torch.softmax(last, dim=-1)
            chosen = [int(torch.multinomial(probs[i], 1, generator=generators[row]))
                      for i, row in enumerate(writing)]
        # the loss of the sampled positions only: the cross-entropy is row-wise, so scoring them alone gives what
        # the same function computes over the whole batch
        step_logps = -token_loss(torch.as_tensor(chosen).unsqueeze(1), logits[picked, at].unsqueeze(1))[:, 0]
        for i, (row, token) in enumerate(zip(writing, chosen, strict=True)):
            logps[row, lengths[row] - 1] = step_logps[i]
            ids[row, lengths[row]] = token
            lengths[row] += 1
            live[row] = token not in stop_ids and lengths[row] <= width
    return _laid_out(ids, starts, lengths, logps, stop_ids)


def _laid_out(ids: torch.Tensor, starts: Sequence[int], lengths: Sequence[int], logps: torch.Tensor,
              stop_ids: Collection[int]) -> Replies:
    """:class:`Replies` from ``[rows, width + 1]`` ids holding each prompt (up to ``starts``) and its reply (up to
    ``lengths``), and each label's sampled log-prob."""
    rows, width = ids.shape[0], ids.shape[1] - 1
    loss_mask = torch.zeros(rows, width)
    replies, ended = [], []
    for row in range(rows):
        loss_mask[row, starts[row] - 1 : lengths[row] - 1] = 1.0
        reply = ids[row, starts[row] : lengths[row]].tolist()
        ended.append(bool(reply) and reply[-1] in stop_ids)
        replies.append(reply[:-1] if ended[-1] else reply)
    positions = torch.arange(width).unsqueeze(0).expand(rows, width).clone()
    return Replies(ids[:, :width].clone(), ids[:, 1:].clone(), loss_mask, positions, logps * loss_mask, replies,
                   ended)


def sample_replies_cached(model: Any, prompts: Sequence[np.ndarray], *, width: int, max_new_tokens: int,
                          vocab_size: int, stop_ids: Collection[int], pad_id: int,
                          seeds: Sequence[int] | None) -> Replies:
    """:func:`sample_replies` through the KV-cache generator (:func:`loongforge.models.generate.sample_batch`):
    one token's forward per step instead of the whole batch's, so several times faster, but its log-probs are the
    cached forward's, which round differently from the trainer's (``rl/logprob_diff_max`` shows by how much; the
    importance-sampling correction accounts for it). The same replies' layout; ``seeds=None``: greedy."""
    from loongforge.models.generate import sample_batch

    limits = [min(max_new_tokens, width + 1 - len(prompt)) for prompt in prompts]
    sampled = sample_batch(model, [prompt.tolist() for prompt in prompts], limits, vocab_size=vocab_size,
                           max_positions=width + 1, temperature=0.0 if seeds is None else 1.0,
                           seed=0 if seeds is None else seeds, stop_ids=stop_ids)
    rows = len(prompts)
    ids = torch.full((rows, width + 1), pad_id, dtype=torch.long)
    logps = torch.zeros(rows, width)
    starts, lengths = [], []
    for row, prompt in enumerate(prompts):
        reply = sampled.ids[row] + ([] if sampled.stops[row] is None else [sampled.stops[row]])
        start, end = len(prompt), len(prompt) + len(reply)
        ids[row, :start] = torch.as_tensor(prompt)
        ids[row, start:end] = torch.as_tensor(reply, dtype=torch.long)
        logps[row, start - 1 : end - 1] = torch.as_tensor(sampled.logprobs[row])
        starts.append(start)
        lengths.append(end)
    return _laid_out(ids, starts, lengths, logps, stop_ids)
