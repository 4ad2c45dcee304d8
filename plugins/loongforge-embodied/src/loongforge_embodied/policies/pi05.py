"""A Pi0.5-style vision-language-action policy in plain torch: a prefix transformer over image patches, the task
text and the discretised state, and an action expert that denoises an action chunk by flow matching.

What it shares with Pi0.5 (Physical Intelligence's openpi, LeRobot's ``PI05Policy``):

- The prefix is [image tokens, task text tokens, state tokens]; the state is quantised into 256 bins and written
  into the prompt as tokens (Pi0.5 has no continuous state projection). Prefix attention is bidirectional. A
  state-only flavor (``cameras: 0``) has no image tokens.
- Two streams with their own weights (the VLM and the smaller action expert) meet in every layer through one
  joint attention: queries, keys and values of both are concatenated, a prefix token attends to the prefix only,
  an action token to the prefix and to every action token. Both streams share the head geometry, not the width.
- Time enters the action expert through adaptive RMSNorm: the flow time's sinusoidal embedding, through a small
  MLP, gives each norm a scale, shift and residual gate (zero-initialised, so expert layers start as identity).
- Rotary positions run over the valid prefix tokens and continue into the action chunk.

Where it differs: real Pi0.5 is PaliGemma 3B (SigLIP So400m image encoder, Gemma 2B, 257k SentencePiece vocabulary)
with a Gemma-300M expert; here a small patch-embedding ViT replaces SigLIP, byte-level ids replace the tokenizer
(pad 0, bytes 1..256, state bins after), and widths are tiny. The KV cache used at inference is not built:
sampling reruns the prefix every Euler step (the same numbers, more compute). The layers shared with Pi0 live in
:mod:`~loongforge_embodied.policies.blocks`.

Knowledge insulation (Physical Intelligence, "Knowledge Insulating Vision-Language-Action Models", 2025), built
when the flavor holds ``action_vocab`` > 0 FAST ids: the backbone also reads the chunk's FAST tokens after the
prefix (their ids follow the state bins, then a BOS and an EOS marker, as :class:`~loongforge_embodied.policies.
pi0_fast.ActionIds` lays them out) and predicts each next one through a language head (untied, as Pi0-FAST's here:
tied to this model's unit-variance embedding its first logits are huge), while the action expert reads the prefix's
keys and values with their gradient stopped and never the FAST tokens (:meth:`~loongforge_embodied.policies.blocks.
JointPolicy.run_insulated`). So the flow loss trains the expert alone, the backbone learns from the FAST
cross-entropy alone, and acting (no FAST tokens) runs the expert as training did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.blocks import AdaRMSNorm, JointPolicy, RMSNorm, time_embedding
from loongforge_embodied.policies.flavors import Pi05Flavor


class Pi05Policy(JointPolicy):
    """``forward(inputs, noisy_actions, time) -> velocity``; see the module docstring.

    :param inputs: ``"tokens"`` (B, text_len + max_state_dim) prompt ids from :func:`~loongforge_embodied.policies.
        prompt.prompt_tokens` (0 = padding, masked out as a key) and, when the flavor has cameras, ``"images"``
        (B, cameras, 3, S, S) in [0, 1].
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time (1 = pure noise).
    :param action_tokens: knowledge insulation only (``flavor.action_vocab`` > 0): (B, T) FAST inputs
        ``[BOS, a_1, ...]``; then the output is ``(velocity, logits (B, T, vocab))``, logits[:, j] predicting id j + 1.
    """

    def __init__(self, flavor: Pi05Flavor) -> None:
        super().__init__(flavor, vocab=flavor.vocab_size, expert_cond=flavor.expert_width,
                         prefix_output=flavor.action_vocab > 0)
        e = flavor.expert_width
        self.action_in = nn.Linear(flavor.max_action_dim, e)
        self.time_in = nn.Linear(e, e)
        self.time_out = nn.Linear(e, e)
        self.final_norm = AdaRMSNorm(e, e, flavor.eps, gated=False)
        self.action_out = nn.Linear(e, flavor.max_action_dim)
        if flavor.action_vocab:  # created last: a flavor without it initialises exactly as before
            self.token_norm = RMSNorm(flavor.width, flavor.eps)
            self.token_head = nn.Linear(flavor.width, flavor.vocab_size, bias=False)

    def condition(self, time: torch.Tensor) -> torch.Tensor:
        """The adaRMS conditioning vector of flow time ``time`` (B,)."""
        emb = time_embedding(time, self.flavor.expert_width)
        return F.silu(self.time_out(F.silu(self.time_in(emb))))

    def forward(self, inputs: dict[str, torch.Tensor], noisy_actions: torch.Tensor, time: torch.Tensor,
                action_tokens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        prefix, valid = self.embed_prefix(inputs)
        cond = self.condition(time)
        actions = self.action_in(noisy_actions)
        if not self.flavor.action_vocab:
            if action_tokens is not None:
                raise ValueError("action_tokens need a flavor with action_vocab > 0 (knowledge insulation)")
            actions = self.run(prefix, valid, actions, [1] * noisy_actions.shape[1], cond)
            return self.action_out(self.final_norm(actions, cond)[0])
        ids = action_tokens if action_tokens is not None else valid.new_zeros(valid.shape[0], 0, dtype=torch.long)
        tokens, actions = self.run_insulated(prefix, valid, self.embed_ids(ids), actions, cond)
        velocity = self.action_out(self.final_norm(actions, cond)[0])
        if action_tokens is None:
            return velocity
        return velocity, self.token_head(self.token_norm(tokens)[0])
