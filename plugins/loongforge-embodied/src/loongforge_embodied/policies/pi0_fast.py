"""A Pi0-FAST-style autoregressive VLA policy in plain torch: one transformer reads the observation as a prefix and
predicts the action chunk as tokens (FAST, or OpenVLA's per-value bins), which a tokenizer decodes to actions.

What it shares with Pi0-FAST (openpi's ``pi0_fast``):

- One stream, one set of weights (no action expert): the action tokens are more tokens of the VLM's sequence,
  embedded by the same table and read out by a language-model head over the whole vocabulary.
- The attention is a prefix-LM's: the prefix (images, task text, state) is bidirectional, each action token sees the
  prefix and the action tokens before it (:func:`~loongforge_embodied.policies.blocks.joint_mask` with one block per
  action token). Rotary positions run over the valid prefix tokens and continue into the actions.
- The sequence after the prefix is ``[BOS, a_1, ..., a_n, EOS]``; training is next-token cross-entropy on the action
  tokens and EOS only (:func:`action_token_loss`), never on the prefix.
- Acting is greedy decoding from BOS until EOS (or the longest training sequence), with a KV cache: the prefix runs
  once and each new token attends to the cached keys and values (:meth:`Pi0FastPolicy.generate`; ``cache=False``
  recomputes the whole sequence per token, the same numbers). Decoding is restricted to the action ids and EOS.

Where it differs: the state is one continuous token (``Linear(max_state_dim -> width)`` of the normalised,
zero-padded state, Pi0's way) at the end of the prefix instead of Pi0-FAST's discretised state written into the
prompt -- on a tiny model trained for minutes a projection of the state is far easier to learn than 256 bin
embeddings per value. Byte ids replace PaliGemma's SentencePiece tokenizer and the action ids are their own rows
after the bytes (Pi0-FAST maps them onto the last rows of the 257k vocabulary). The layers are those of
:mod:`~loongforge_embodied.policies.blocks` (RMSNorm, GeGLU, rotary attention), sized by
:class:`~loongforge_embodied.policies.fast_flavors.Pi0FastFlavor`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.blocks import (
    RMSNorm,
    Stream,
    build_image_tower,
    embed_images,
    joint_mask,
    positions,
    rope_angles,
    rotate,
    split_heads,
)
from loongforge_embodied.policies.fast_flavors import Pi0FastFlavor

#: Keys and values of one layer, (B, heads, N, head_dim) each, after the rotary embedding.
KV = tuple[torch.Tensor, torch.Tensor]
#: Target id that carries no loss (prefix positions, padding after EOS).
IGNORE = -100


class ActionIds:
    """Where the action tokens of a tokenizer with ``action_vocab`` ids sit in the policy's vocabulary: tokenizer id
    ``k`` is ``offset + k`` (``flavor.action_offset``); BOS and EOS follow the flavor's ``action_vocab`` rows."""

    def __init__(self, flavor: Any) -> None:
        self.offset = flavor.action_offset
        self.bos = self.offset + flavor.action_vocab
        self.eos = self.bos + 1

    def sequence(self, ids: list[int], length: int) -> torch.Tensor:
        """(length + 2,) ``[BOS, ids..., EOS]`` padded with 0: the model's input is all but the last, its target all
        but the first (:func:`action_token_loss` ignores the padding)."""
        out = torch.zeros(length + 2, dtype=torch.long)
        seq = [self.bos, *(self.offset + i for i in ids), self.eos]
        out[:len(seq)] = torch.tensor(seq[:length + 2])
        return out

    def tokenizer_ids(self, ids: list[int]) -> list[int]:
        """Generated ids back to the tokenizer's (markers and text ids dropped; they are never generated)."""
        return [i - self.offset for i in ids if self.offset <= i < self.bos]


def action_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, N, V) over the positions whose ``targets`` (B, N) are not
    :data:`IGNORE` -- the action tokens and EOS; the prefix's positions carry :data:`IGNORE`."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


class Layer(nn.Module):
    """A pre-norm layer with rotary attention that can extend cached keys and values (``past``)."""

    def __init__(self, flavor: Pi0FastFlavor) -> None:
        super().__init__()
        self.heads = flavor.heads
        self.stream = Stream(flavor.width, flavor, cond_dim=None, output=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """``x`` (B, N, width) attends to ``past`` then itself under ``mask`` (B, 1, N, len(past) + N); returns the
        output and the keys/values including ``past``'s."""
        h, _ = self.stream.norm1(x)
        q, k, v = (split_heads(t, self.heads) for t in self.stream.qkv(h).chunk(3, dim=-1))
        q, k = rotate(q, *rope), rotate(k, *rope)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        return self.stream.finish(x, attended, None, None), (k, v)


class Pi0FastPolicy(nn.Module):
    """``forward(inputs, action_inputs) -> logits`` (B, P + S, vocab) over the prefix and ``action_inputs`` (B, S)
    (``[BOS, a_1, ...]``); :meth:`generate` decodes; see the module docstring.

    :param inputs: ``"tokens"`` (B, text_len) task text ids (0 = padding), ``"state"`` (B, max_state_dim) the
        normalised zero-padded state and, when the flavor has cameras, ``"images"`` (B, cameras, 3, S, S) in [0, 1].
    """

    def __init__(self, flavor: Pi0FastFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        self.ids = ActionIds(flavor)
        build_image_tower(self, flavor)
        self.token_embed = nn.Embedding(flavor.vocab_size, flavor.width)
        self.state_proj = nn.Linear(flavor.max_state_dim, flavor.width)
        self.layers = nn.ModuleList(Layer(flavor) for _ in range(flavor.depth))
        self.final_norm = RMSNorm(flavor.width, flavor.eps)
        self.head = nn.Linear(flavor.width, flavor.vocab_size, bias=False)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_embed(ids) * math.sqrt(self.flavor.width)  # Gemma scales its embeddings

    def embed_prefix(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix tokens (B, P, width) and their validity (B, P): image tokens, task bytes, the state token."""
        tokens = inputs["tokens"]
        parts = [self._embed(tokens), self.state_proj(inputs["state"])[:, None]]
        valid = [tokens != 0, tokens.new_ones(tokens.shape[0], 1, dtype=torch.bool)]
        if self.flavor.cameras:
            images = embed_images(self, inputs["images"])
            parts.insert(0, images)
            valid.insert(0, tokens.new_ones(images.shape[:2], dtype=torch.bool))
        return torch.cat(parts, dim=1), torch.cat(valid, dim=1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(x)[0])

    def forward(self, inputs: dict[str, torch.Tensor], action_inputs: torch.Tensor) -> torch.Tensor:
        prefix, valid = self.embed_prefix(inputs)
        steps = action_inputs.shape[1]
        x = torch.cat([prefix, self._embed(action_inputs)], dim=1)
        mask = joint_mask(valid, range(1, steps + 1))
        rope = rope_angles(self.flavor, positions(valid, steps), x.dtype)
        for layer in self.layers:
            x, _ = layer(x, mask, rope)
        return self._logits(x)

    @torch.no_grad()
    def generate(self, inputs: dict[str, torch.Tensor], max_tokens: int, *, cache: bool = True) -> list[list[int]]:
        """Greedy action ids (the tokenizer's) for each observation: from BOS until EOS or ``max_tokens`` ids."""
        tokens, _ = self.greedy(inputs, max_tokens, cache=cache)
        rows = [row[:row.index(self.ids.eos)] if self.ids.eos in row else row for row in tokens.tolist()]
        return [self.ids.tokenizer_ids(row) for row in rows]

    @torch.no_grad()
    def greedy(self, inputs: dict[str, torch.Tensor], max_tokens: int, *,
               cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) chosen ids and (B, T, vocab) the logits they were chosen from, T <= ``max_tokens``: each step
        picks the most likely of the action ids and EOS (a row that chose EOS keeps choosing it), until every row
        has chosen EOS. ``cache=False`` reruns the whole sequence for each token instead of extending the cache."""
        prefix, valid = self.embed_prefix(inputs)
        allowed = torch.full((self.flavor.vocab_size,), float("-inf"), device=prefix.device)
        allowed[self.ids.offset:self.ids.bos] = 0.0
        allowed[self.ids.eos] = 0.0
        sequence = torch.full((prefix.shape[0], 1), self.ids.bos, dtype=torch.long, device=prefix.device)
        done = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
        past = self._prefix_cache(prefix, valid) if cache else None
        steps: list[torch.Tensor] = []
        for step in range(max_tokens):
            if past is not None:
                logits, past = self._step(sequence[:, -1:], valid, step, past)
            else:
                logits = self.forward(inputs, sequence)[:, -1]
            steps.append(logits + allowed)
            choice = torch.where(done, self.ids.eos, steps[-1].argmax(dim=-1))
            sequence = torch.cat([sequence, choice[:, None]], dim=1)
            done |= choice == self.ids.eos
            if done.all():
                break
        return sequence[:, 1:], torch.stack(steps, dim=1)

    def _prefix_cache(self, prefix: torch.Tensor, valid: torch.Tensor) -> list[KV]:
        """Every layer's keys and values of the prefix (which never attends to the actions, so they are final)."""
        mask = joint_mask(valid, [])
        rope = rope_angles(self.flavor, positions(valid, 0), prefix.dtype)
        past = []
        x = prefix
        for layer in self.layers:
            x, kv = layer(x, mask, rope)
            past.append(kv)
        return past

    def _step(self, token: torch.Tensor, valid: torch.Tensor, step: int,
              past: list[KV]) -> tuple[torch.Tensor, list[KV]]:
        """Logits (B, vocab) after the action-sequence token ``token`` (B, 1) at suffix position ``step``."""
        batch = token.shape[0]
        x = self._embed(token)
        keys = torch.cat([valid, valid.new_ones(batch, step + 1)], dim=1)[:, None, None, :]
        position = valid.long().sum(dim=1, keepdim=True) + step
        rope = rope_angles(self.flavor, position, x.dtype)
        new_past = []
        for layer, kv in zip(self.layers, past, strict=True):
            x, kv = layer(x, keys, rope, kv)
            new_past.append(kv)
        return self._logits(x)[:, -1], new_past

