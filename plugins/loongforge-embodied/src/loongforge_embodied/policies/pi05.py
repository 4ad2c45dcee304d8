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
(pad 0, bytes 1..256, state bins after), and widths are tiny. Pi0.5's discrete FAST-token/language loss
(knowledge insulation) and the KV cache used at inference are not built: sampling reruns the prefix every Euler
step (the same numbers, more compute). The layers shared with Pi0 live in :mod:`~loongforge_embodied.policies.blocks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.blocks import AdaRMSNorm, JointPolicy, time_embedding
from loongforge_embodied.policies.flavors import Pi05Flavor
from loongforge_embodied.policies.prompt import vocab_size


class Pi05Policy(JointPolicy):
    """``forward(inputs, noisy_actions, time) -> velocity``; see the module docstring.

    :param inputs: ``"tokens"`` (B, text_len + max_state_dim) prompt ids from :func:`~loongforge_embodied.policies.
        prompt.prompt_tokens` (0 = padding, masked out as a key) and, when the flavor has cameras, ``"images"``
        (B, cameras, 3, S, S) in [0, 1].
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time (1 = pure noise).
    """

    def __init__(self, flavor: Pi05Flavor) -> None:
        super().__init__(flavor, vocab=vocab_size(flavor.state_bins), expert_cond=flavor.expert_width)
        e = flavor.expert_width
        self.action_in = nn.Linear(flavor.max_action_dim, e)
        self.time_in = nn.Linear(e, e)
        self.time_out = nn.Linear(e, e)
        self.final_norm = AdaRMSNorm(e, e, flavor.eps, gated=False)
        self.action_out = nn.Linear(e, flavor.max_action_dim)

    def condition(self, time: torch.Tensor) -> torch.Tensor:
        """The adaRMS conditioning vector of flow time ``time`` (B,)."""
        emb = time_embedding(time, self.flavor.expert_width)
        return F.silu(self.time_out(F.silu(self.time_in(emb))))

    def forward(self, inputs: dict[str, torch.Tensor], noisy_actions: torch.Tensor,
                time: torch.Tensor) -> torch.Tensor:
        prefix, valid = self.embed_prefix(inputs)
        cond = self.condition(time)
        actions = self.run(prefix, valid, self.action_in(noisy_actions), [1] * noisy_actions.shape[1], cond)
        return self.action_out(self.final_norm(actions, cond)[0])
