"""Sampling replies so that the log-prob of every sampled token is, bit for bit, what the training step recomputes.

Why the KV-cache generator alone (:mod:`loongforge.models.generate`) is not exact: a cached decoding step multiplies
one new token at a time, and floating-point sums come out differently for other matrix shapes (on the CPU a matrix
product of a few rows takes another kernel than one of many; a softmax over 11 keys another order than over 48), so
its log-probs -- and, rarely, its picks -- differ from the trainer's in the last bits: the mismatch RL trainers
report between their rollout engine and their trainer, which biases the importance ratio.

What :func:`sample_replies` does instead, speculative decoding with the trainer as the verifier:

1. **draft** -- the replies are drafted by the KV-cache generator (``draft``), every token picked from the inverse
   CDF of its distribution at a per-token draw fixed in advance (``uniforms``: one per reply and token);
2. **verify** -- one forward of the policy over the whole ``[rows, seq_length]`` batch the training step will run,
   with the drafted tokens in place. Causal attention makes each position's logits depend on the tokens before it
   only, bit for bit (the later positions get exactly zero weight; a row's sums never mix with another row's), so
   the logits at the first drafted position are the trainer's, and the trainer's pick there at the same draw is the
   exact sampler's token. Where it equals the draft, the next position's logits are the trainer's too, and so on:
   each row keeps its drafted tokens up to and including the first the trainer picks differently (replaced by the
   trainer's pick), and the log-prob of every kept token is taken from these logits by the model's own loss function
   (megatron's vocab-parallel cross-entropy, at any tensor-parallel size);
3. rows cut short by a replaced pick are drafted again from there, until every reply has ended.

The replies and log-probs are therefore exactly those of sampling one token per full forward (``draft=None``, which
this function then does, slowly: one forward per token), whatever the draft got wrong; a draft that agrees (almost
always: the two differ in the last bits) costs one extra forward per batch. The sampling is from the policy itself
(temperature 1, no top-k/top-p: the importance ratio and the KL term are about that distribution), over the
tokenizer's ids (megatron pads the vocabulary; the padded rows are never chosen). Each reply has its own draws, so
what it samples does not depend on the rows batched with it; ``uniforms=None`` decodes greedily (evaluation). Every
tensor-parallel rank samples the same tokens: the gathered logits and the draws are the same on all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loongforge.models.generate import gather_vocab, pick


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


def reply_uniforms(seeds: Sequence[int], max_new_tokens: int) -> torch.Tensor:
    """Each reply's draws, ``[replies, max_new_tokens]``: the ``k``-th picks the reply's ``k``-th token."""
    return torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.float64) for seed in seeds])


#: A drafter: ``(prefixes, limits, uniforms)`` -> each prefix's proposed continuation (at most its limit of ids, a
#: stop id included where it stopped), picked with the given draws (``None``: greedily).
Draft = Callable[[Sequence[list[int]], Sequence[int], Sequence[torch.Tensor] | None], list[list[int]]]


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
    uniforms: torch.Tensor | None,
    draft: Draft | None = None,
) -> Replies:
    """Extend each prompt by up to ``max_new_tokens`` sampled ids (see the module docstring).

    ``forward(tokens, position_ids)`` is the policy's logits ``[rows, width, vocab shard]``; ``token_loss(labels,
    logits)`` the model's per-token loss of them (``[rows, width]``, ``-log p``). A reply stops after one of
    ``stop_ids`` (kept: the model learns to stop) or when its row is full (``width + 1`` ids: inputs and labels).
    ``uniforms`` (``[rows, max_new_tokens]``, see :func:`reply_uniforms`) are the draws, ``None`` greedy."""
    rows = len(prompts)
    ids = torch.full((rows, width + 1), pad_id, dtype=torch.long)
    lengths = [len(prompt) for prompt in prompts]
    for row, prompt in enumerate(prompts):
        ids[row, : lengths[row]] = torch.as_tensor(prompt, dtype=torch.long)
    starts = list(lengths)
    positions = torch.arange(width).unsqueeze(0).expand(rows, width)
    logps = torch.zeros(rows, width)
    live = [length <= width and max_new_tokens > 0 for length in lengths]

    def room(row: int) -> int:  # the ids the row may still take: its budget, and its row's end
        return min(max_new_tokens - (lengths[row] - starts[row]), width + 1 - lengths[row])

    while any(live):
        writing = [row for row in range(rows) if live[row]]
        proposed = ids.clone()
        if draft is not None:
            drafted = draft([ids[row, : lengths[row]].tolist() for row in writing], [room(row) for row in writing],
                            None if uniforms is None else [uniforms[row, lengths[row] - starts[row]:]
                                                           for row in writing])
            for row, tokens in zip(writing, drafted, strict=True):
                proposed[row, lengths[row] : lengths[row] + len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        logits = forward(proposed[:, :width], positions)
        # the positions whose logits may be kept: from each row's first new token to its draft's end
        spans = [(row, at) for row in writing for at in range(lengths[row] - 1, lengths[row] - 1 + room(row))]
        where_rows, where_at = (torch.as_tensor(column) for column in zip(*spans, strict=True))
        candidates = logits[where_rows, where_at]
        scores = gather_vocab(candidates)[:, :vocab_size].float()
        if uniforms is not None:
            scores = torch.softmax(scores, dim=-1)
        kept_rows, kept_at, kept_tokens, kept_index = [], [], [], []
        index = 0
        for row in writing:
            span = room(row)
            for offset in range(span):
                at = lengths[row] - 1
                draw = None if uniforms is None else float(uniforms[row, lengths[row] - starts[row]])
                token = int(scores[index + offset].argmax()) if draw is None else pick(scores[index + offset], draw)
                kept_rows.append(row), kept_at.append(at), kept_tokens.append(token), kept_index.append(index + offset)
                ids[row, at + 1] = token
                lengths[row] += 1
                live[row] = token not in stop_ids and room(row) > 0
                # the next position's logits are the trainer's only while the draft agrees with every pick so far
                if not live[row] or token != int(proposed[row, at + 1]):
                    break
            index += span
        # the loss of the kept positions only: the cross-entropy is row-wise, so scoring them alone gives what the
        # same function computes over the whole batch
        chosen = torch.as_tensor(kept_tokens).unsqueeze(1)
        kept_logps = -token_loss(chosen, candidates[torch.as_tensor(kept_index)].unsqueeze(1))[:, 0]
        logps[torch.as_tensor(kept_rows), torch.as_tensor(kept_at)] = kept_logps
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


def kv_cache_draft(model: Any, vocab_size: int, stop_ids: Collection[int]) -> Draft:
    """A :data:`Draft` by the KV-cache generator (:func:`loongforge.models.generate.sample_batch`): one token's
    forward per step instead of the whole batch's."""
    from loongforge.models.generate import sample_batch

    def drafted(prefixes: Sequence[list[int]], limits: Sequence[int],
                uniforms: Sequence[torch.Tensor] | None) -> list[list[int]]:
        sampled = sample_batch(model, prefixes, list(limits), vocab_size=vocab_size,
                               max_positions=max(len(p) + n for p, n in zip(prefixes, limits, strict=True)),
                               temperature=0.0 if uniforms is None else 1.0, stop_ids=stop_ids,
                               uniforms=None if uniforms is None else [u.tolist() for u in uniforms])
        return [ids + ([] if stop is None else [stop]) for ids, stop in zip(sampled.ids, sampled.stops, strict=True)]

    return drafted


def sample_replies_cached(model: Any, prompts: Sequence[np.ndarray], *, width: int, max_new_tokens: int,
                          vocab_size: int, stop_ids: Collection[int], pad_id: int,
                          uniforms: torch.Tensor | None) -> Replies:
    """The KV-cache generator's replies, unverified: its own log-probs, which round differently from the trainer's
    (``rl/logprob_diff_max`` shows by how much; the importance-sampling correction accounts for it) -- what an
    external rollout engine gives. The same replies' layout and draws as :func:`sample_replies`."""
    from loongforge.models.generate import sample_batch

    limits = [min(max_new_tokens, width + 1 - len(prompt)) for prompt in prompts]
    sampled = sample_batch(model, [prompt.tolist() for prompt in prompts], limits, vocab_size=vocab_size,
                           max_positions=width + 1, temperature=0.0 if uniforms is None else 1.0, stop_ids=stop_ids,
                           uniforms=None if uniforms is None else uniforms.tolist())
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
