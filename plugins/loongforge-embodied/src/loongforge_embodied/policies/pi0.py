"""A Pi0-style vision-language-action policy in plain torch (openpi's ``pi0``, LeRobot's ``PI0Policy``): the same
prefix transformer and action expert as :mod:`~loongforge_embodied.policies.pi05`, with Pi0's way of feeding the
robot state and the flow time to the expert.

How Pi0 differs from Pi0.5:

- The state is not written into the prompt: it is one continuous token, ``Linear(max_state_dim -> expert
  width)`` of the normalised, zero-padded state, at the start of the expert's stream.
- Time is not adaptive RMSNorm: each action token is ``Linear(action)`` concatenated with the flow time's
  sinusoidal embedding, through ``Linear(2w -> w)``, swish, ``Linear(w -> w)`` ("action_time_mlp"); the expert's
  norms are plain RMSNorms.
- Attention is block-causal over three blocks: the prefix (images + text) sees itself only, the state token the
  prefix and itself, the action tokens the prefix, the state and every action token. Rotary positions continue
  after the valid prefix tokens (state first, then the chunk).

The flow-matching convention is Pi0's, as for Pi0.5 (:mod:`~loongforge_embodied.policies.flow_matching`). What
this stand-in leaves out of real Pi0 (PaliGemma 3B, SigLIP, the SentencePiece tokenizer) is as for Pi0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.blocks import JointPolicy, RMSNorm, time_embedding
from loongforge_embodied.policies.flavors import Pi0Flavor
from loongforge_embodied.policies.prompt import vocab_size

#: Attention blocks of the expert's stream: the state token, then the action tokens.
STATE_BLOCK, ACTION_BLOCK = 1, 2


class Pi0Policy(JointPolicy):
    """``forward(inputs, noisy_actions, time) -> velocity``; see the module docstring.

    :param inputs: ``"tokens"`` (B, text_len) task text ids (0 = padding), ``"state"`` (B, max_state_dim) the
        normalised zero-padded state and, when the flavor has cameras, ``"images"`` (B, cameras, 3, S, S) in [0, 1].
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time (1 = pure noise).
    """

    def __init__(self, flavor: Pi0Flavor) -> None:
        super().__init__(flavor, vocab=vocab_size(0), expert_cond=None)
        e = flavor.expert_width
        self.state_proj = nn.Linear(flavor.max_state_dim, e)
        self.action_in = nn.Linear(flavor.max_action_dim, e)
        self.action_time_in = nn.Linear(2 * e, e)
        self.action_time_out = nn.Linear(e, e)
        self.final_norm = RMSNorm(e, flavor.eps)
        self.action_out = nn.Linear(e, flavor.max_action_dim)

    def embed_suffix(self, state: torch.Tensor, noisy_actions: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """(B, 1 + H, expert width): the state token, then the action tokens with the time mixed in."""
        actions = self.action_in(noisy_actions)
        times = time_embedding(time, self.flavor.expert_width)[:, None].expand_as(actions)
        actions = self.action_time_out(F.silu(self.action_time_in(torch.cat([actions, times], dim=-1))))
        return torch.cat([self.state_proj(state)[:, None], actions], dim=1)

    def forward(self, inputs: dict[str, torch.Tensor], noisy_actions: torch.Tensor,
                time: torch.Tensor) -> torch.Tensor:
        prefix, valid = self.embed_prefix(inputs)
        suffix = self.embed_suffix(inputs["state"], noisy_actions, time)
        blocks = [STATE_BLOCK] + [ACTION_BLOCK] * noisy_actions.shape[1]
        suffix = self.run(prefix, valid, suffix, blocks, None)
        return self.action_out(self.final_norm(suffix[:, 1:])[0])
