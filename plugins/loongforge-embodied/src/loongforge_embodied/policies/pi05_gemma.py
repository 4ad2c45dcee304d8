"""Pi0.5 with PaliGemma's exact architecture, in plain torch: what LeRobot's ``PI05Pytorch`` and openpi's
``PI0Pytorch(pi05=True)`` compute, at any size (``pi05-base`` is the published 3B one).

- Prefix: every camera's image through SigLIP (:class:`loongforge_vlm.encoders.siglip.SiglipVisionEncoder`,
  images in [0, 1] mapped to [-1, 1]) and PaliGemma's linear projector (not rescaled), then the prompt's token
  embeddings times ``sqrt(width)``. The prompt carries the discretised state (:mod:`~loongforge_embodied.policies.
  prompt`). Id 0 is padding: masked as a key, and it does not advance the positions.
- Suffix: ``Linear(noisy action)`` per chunk step. The flow time's sinusoidal embedding (periods 4e-3..4) goes
  through ``silu(time_mlp_out(silu(time_mlp_in(.))))`` and conditions every adaptive RMSNorm of the action expert.
- Layer by layer, the Gemma LM (prefix) and the Gemma action expert (suffix) each normalise and project their own
  tokens; one attention runs over the concatenation (:func:`~loongforge_embodied.policies.gemma.joint_attention`).
  The mask is big_vision's prefix-LM with the suffix as one new block: the prefix attends to itself
  (bidirectionally), an action token to the whole prefix and every action token. Rotary positions are the running
  count of real tokens minus one, over prefix then suffix.
- Output: the expert's final adaptive norm, then ``action_out_proj`` -> the velocity ``noise - actions``.

Sampling (:meth:`Pi05GemmaPolicy.sample_actions`) integrates with Euler from ``t = 1``; it runs the prefix once
and reuses its keys/values at every step, as LeRobot does. Prefix tokens never attend to the suffix, so this is
what calling :meth:`~Pi05GemmaPolicy.forward` every step computes (the policy protocol's way), with less work.
The last layer's prefix outputs and the LM's final norm feed nothing; they are kept so that a checkpoint
converts losslessly, but neither computed nor trained (``requires_grad`` False).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from loongforge_vlm.encoders.siglip import SiglipVisionEncoder
from torch import nn

from loongforge_embodied.policies import flow_matching
from loongforge_embodied.policies.blocks import time_embedding
from loongforge_embodied.policies.gemma import GemmaLayer, GemmaRMSNorm, joint_attention, prefix_lm_mask
from loongforge_embodied.policies.pi05_gemma_flavors import Pi05GemmaFlavor


class JointLayer(nn.Module):
    """One layer of both streams: ``prefix`` (the PaliGemma LM's layer) and ``expert`` (adaptive norms)."""

    def __init__(self, flavor: Pi05GemmaFlavor) -> None:
        super().__init__()
        f = flavor
        self.prefix = GemmaLayer(f.width, f.mlp_dim, f.heads, f.kv_heads, f.head_dim, f.eps)
        self.expert = GemmaLayer(f.expert_width, f.expert_mlp_dim, f.heads, f.kv_heads, f.head_dim, f.eps,
                                 cond_dim=f.expert_width)

    def forward(self, prefix: torch.Tensor, suffix: torch.Tensor, cond: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, theta: float, *, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Both streams through the layer; ``mask`` (B, P + H, P + H), ``positions`` (B, P + H)."""
        split = prefix.shape[1]
        if last:  # nothing reads the prefix's last outputs: only its keys and values are needed
            _, kv = self.run_prefix(prefix, positions[:, :split], mask[:, :split, :split], theta, last=True)
            return prefix, self.run_suffix(suffix, cond, kv, positions, mask[:, split:], theta)
        qp, kp, vp, gate_p = self.prefix.qkv(prefix, None)
        qs, ks, vs, gate_s = self.expert.qkv(suffix, cond)
        out = joint_attention([qp, qs], [kp, ks], [vp, vs], positions, mask, theta)
        return (self.prefix.finish(prefix, out[:, :split], gate_p, None),
                self.expert.finish(suffix, out[:, split:], gate_s, cond))

    def run_prefix(self, prefix: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, theta: float, *,
                   last: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The prefix alone (it never attends to the suffix): ``(its output, its (keys, values))``; the output is
        the input when ``last`` (nothing reads it)."""
        q, k, v, gate = self.prefix.qkv(prefix, None, queries=not last)
        if last:
            return prefix, (k, v)
        return self.prefix.finish(prefix, joint_attention([q], [k], [v], positions, mask, theta), gate, None), (k, v)

    def run_suffix(self, suffix: torch.Tensor, cond: torch.Tensor, prefix_kv: tuple[torch.Tensor, torch.Tensor],
                   positions: torch.Tensor, mask: torch.Tensor, theta: float) -> torch.Tensor:
        """The action expert's stream given the prefix's keys and values: ``mask`` holds the suffix rows
        (B, H, P + H), ``positions`` all P + H tokens."""
        q, k, v, gate = self.expert.qkv(suffix, cond)
        out = joint_attention([q], [prefix_kv[0], k], [prefix_kv[1], v], positions, mask, theta,
                              query_positions=positions[:, prefix_kv[0].shape[2]:])
        return self.expert.finish(suffix, out, gate, cond)


class Pi05GemmaPolicy(nn.Module):
    """``forward(inputs, noisy_actions, time) -> velocity`` (the policy protocol); see the module docstring.

    :param inputs: ``"tokens"`` (B, T) prompt ids (0 = padding); with cameras, ``"images"`` (B, cameras, 3, S, S)
        in [0, 1] and optionally ``"image_masks"`` (B, cameras) bool (False: a missing camera, masked as keys).
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time (1 = pure noise).
    """

    def __init__(self, flavor: Pi05GemmaFlavor) -> None:
        super().__init__()
        f = self.flavor = flavor
        if f.cameras:
            self.vision = SiglipVisionEncoder(f.siglip())
            self.projector = nn.Linear(f.vision_width, f.width)
        self.embed_tokens = nn.Embedding(f.vocab, f.width)
        self.layers = nn.ModuleList(JointLayer(f) for _ in range(f.depth))
        self.norm = GemmaRMSNorm(f.width, f.eps)
        self.expert_norm = GemmaRMSNorm(f.expert_width, f.eps, cond_dim=f.expert_width)
        e = f.expert_width
        self.action_in_proj = nn.Linear(f.max_action_dim, e)
        self.time_mlp_in = nn.Linear(e, e)
        self.time_mlp_out = nn.Linear(e, e)
        self.action_out_proj = nn.Linear(e, f.max_action_dim)
        for unused in self.unused():
            unused.requires_grad_(False)

    def unused(self) -> list[nn.Module]:
        """What no output reads (the last layer's prefix queries, outputs and MLP, the LM's final norm): frozen, so
        that data-parallel wrappers do not wait for their gradients; kept for lossless checkpoint conversion."""
        last = self.layers[-1].prefix
        return [last.q_proj, last.o_proj, last.post_attention_layernorm, last.mlp, self.norm]

    def embed_prefix(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings (B, P, width), real (B, P) bool)``: image tokens of every camera, then the prompt."""
        tokens = inputs["tokens"]
        text = self.embed_tokens(tokens) * math.sqrt(self.flavor.width)
        real = tokens != 0
        if not self.flavor.cameras:
            return text, real
        images = inputs["images"]
        batch, cameras = images.shape[:2]
        pixels = images.flatten(0, 1) * 2.0 - 1.0
        patches = self.projector(self.vision(pixels))
        patches = patches.view(batch, cameras * patches.shape[1], -1)
        shown = inputs.get("image_masks", torch.ones(batch, cameras, dtype=torch.bool, device=tokens.device))
        shown = shown.bool().repeat_interleave(patches.shape[1] // cameras, dim=1)
        return torch.cat([patches, text], dim=1), torch.cat([shown, real], dim=1)

    def condition(self, time: torch.Tensor) -> torch.Tensor:
        """(B, expert width): the adaRMS conditioning of flow time ``time`` (B,)."""
        emb = time_embedding(time, self.flavor.expert_width, self.flavor.min_period, self.flavor.max_period)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def forward(self, inputs: dict[str, torch.Tensor], noisy_actions: torch.Tensor,
                time: torch.Tensor) -> torch.Tensor:
        prefix, real = self.embed_prefix(inputs)
        suffix, cond = self.action_in_proj(noisy_actions), self.condition(time)
        mask, positions = self.attention(real, suffix.shape[1])
        for index, layer in enumerate(self.layers):
            prefix, suffix = layer(prefix, suffix, cond, positions, mask, self.flavor.rope_theta,
                                   last=index == len(self.layers) - 1)
        return self.action_out_proj(self.expert_norm(suffix, cond)[0])

    @staticmethod
    def attention(real: torch.Tensor, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask (B, L, L), rotary positions (B, L))`` over the prefix (``real``: (B, P) False at padding) and
        ``horizon`` action tokens: the prefix-LM mask with the actions as one block after the prefix, and
        positions counting the real tokens only."""
        pad = torch.cat([real, real.new_ones(real.shape[0], horizon)], dim=1)
        starts = torch.zeros_like(pad)
        starts[:, real.shape[1]] = True
        return prefix_lm_mask(pad, starts), torch.cumsum(pad.long(), dim=1) - 1

    @torch.no_grad()
    def sample_actions(self, inputs: dict[str, torch.Tensor], noise: torch.Tensor, steps: int = 10) -> torch.Tensor:
        """Euler-integrate the velocity from ``noise`` (t = 1) to actions (t = 0) in ``steps`` steps, running the
        prefix once and reusing its keys/values every step (what :meth:`forward` computes, less the repeats)."""
        prefix, real = self.embed_prefix(inputs)
        mask, positions = self.attention(real, noise.shape[1])
        split, theta = prefix.shape[1], self.flavor.rope_theta
        cache = []
        for index, layer in enumerate(self.layers):
            prefix, kv = layer.run_prefix(prefix, positions[:, :split], mask[:, :split, :split], theta,
                                          last=index == len(self.layers) - 1)
            cache.append(kv)

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            suffix, cond = self.action_in_proj(x), self.condition(t)
            for layer, kv in zip(self.layers, cache, strict=True):
                suffix = layer.run_suffix(suffix, cond, kv, positions, mask[:, split:], theta)
            return self.action_out_proj(self.expert_norm(suffix, cond)[0])

        return flow_matching.euler_sample(velocity, noise, steps)
