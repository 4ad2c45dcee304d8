"""A Pi0.5-style vision-language-action policy in plain torch: a prefix transformer over image patches, the task
text and the discretised state, and an action expert that denoises an action chunk by flow matching.

What it shares with Pi0.5 (Physical Intelligence's openpi, LeRobot's ``PI05Policy``):

- The prefix is [image tokens, task text tokens, state tokens]; the state is quantised into 256 bins and written
  into the prompt as tokens (Pi0.5 has no continuous state projection). Prefix attention is bidirectional.
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
step (the same numbers, more compute).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.flavors import Pi05Flavor
from loongforge_embodied.policies.prompt import vocab_size


class RMSNorm(nn.Module):
    """Plain RMSNorm; ``forward(x, cond)`` returns ``(y, None)`` so both streams' norms share one interface."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), None


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale and shift (and, when ``gated``, a residual gate) come from the time embedding."""

    def __init__(self, dim: int, cond_dim: int, eps: float, *, gated: bool = True) -> None:
        super().__init__()
        self.eps, self.parts = eps, 3 if gated else 2
        self.modulation = nn.Linear(cond_dim, self.parts * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        mods = self.modulation(cond)[:, None, :].chunk(self.parts, dim=-1)
        y = F.rms_norm(x, (x.shape[-1],), None, self.eps) * (1 + mods[0]) + mods[1]
        return y, mods[2] if self.parts == 3 else None


class GatedMLP(nn.Module):
    """Gemma's GeGLU feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class Stream(nn.Module):
    """One stream's weights in a layer: norm + q/k/v in; with ``output``, the attention output projection, a
    second norm and the MLP. The last joint layer's prefix stream has no output (nothing reads it)."""

    def __init__(self, width: int, flavor: Pi05Flavor, *, cond_dim: int | None, output: bool) -> None:
        super().__init__()
        inner = flavor.heads * flavor.head_dim
        self.norm1 = AdaRMSNorm(width, cond_dim, flavor.eps) if cond_dim else RMSNorm(width, flavor.eps)
        self.qkv = nn.Linear(width, 3 * inner, bias=False)
        self.output = output
        if output:
            self.out = nn.Linear(inner, width, bias=False)
            self.norm2 = AdaRMSNorm(width, cond_dim, flavor.eps) if cond_dim else RMSNorm(width, flavor.eps)
            self.mlp = GatedMLP(width, flavor.mlp_ratio * width)

    def finish(self, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None) -> torch.Tensor:
        """Residual of the attention output, then the MLP block."""
        x = _residual(x, self.out(attended), gate)
        h, gate = self.norm2(x, cond)
        return _residual(x, self.mlp(h), gate)


def _residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads*d) -> (B, heads, N, d)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split pairs) of (B, heads, N, d) with (B, 1, N, d/2) angles."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class VisionLayer(nn.Module):
    """A bidirectional pre-norm transformer layer over one camera's patches (the stand-in for SigLIP)."""

    def __init__(self, flavor: Pi05Flavor) -> None:
        super().__init__()
        self.heads = flavor.heads
        self.stream = Stream(flavor.width, flavor, cond_dim=None, output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.stream.norm1(x)
        q, k, v = (_heads(t, self.heads) for t in self.stream.qkv(h).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.stream.finish(x, attended, None, None)


class JointLayer(nn.Module):
    """Prefix and action streams with separate weights and one attention over both (Pi0's mixture of experts)."""

    def __init__(self, flavor: Pi05Flavor, *, last: bool) -> None:
        super().__init__()
        self.heads = flavor.heads
        self.prefix = Stream(flavor.width, flavor, cond_dim=None, output=not last)
        self.expert = Stream(flavor.expert_width, flavor, cond_dim=flavor.expert_width, output=True)

    def forward(self, prefix: torch.Tensor, actions: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        hp, gate_p = self.prefix.norm1(prefix)
        ha, gate_a = self.expert.norm1(actions, cond)
        qkv = torch.cat([self.prefix.qkv(hp), self.expert.qkv(ha)], dim=1)
        q, k, v = (_heads(t, self.heads) for t in qkv.chunk(3, dim=-1))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        n_prefix = prefix.shape[1]
        actions = self.expert.finish(actions, attended[:, n_prefix:], gate_a, cond)
        prefix = self.prefix.finish(prefix, attended[:, :n_prefix], gate_p, None) if self.prefix.output else None
        return prefix, actions


def joint_mask(prefix_valid: torch.Tensor, horizon: int) -> torch.Tensor:
    """(B, 1, N, N) boolean attention mask (True = may attend) over [prefix, actions], N = P + horizon.

    Every query sees the valid prefix keys; only action queries see action keys (all of them), so the prefix
    never depends on the noisy actions and can be computed once per observation.
    """
    batch, n_prefix = prefix_valid.shape
    n = n_prefix + horizon
    key_valid = torch.cat([prefix_valid, prefix_valid.new_ones(batch, horizon)], dim=1)
    is_action = torch.arange(n, device=prefix_valid.device) >= n_prefix
    allowed = key_valid[:, None, :] & (~is_action[None, :] | is_action[:, None])[None]
    return allowed[:, None]


def positions(prefix_valid: torch.Tensor, horizon: int) -> torch.Tensor:
    """(B, N) rotary positions: counting valid prefix tokens, then the action chunk right after them."""
    prefix_pos = prefix_valid.long().cumsum(dim=1) - 1
    action_pos = prefix_valid.long().sum(dim=1, keepdim=True) + torch.arange(horizon, device=prefix_valid.device)
    return torch.cat([prefix_pos.clamp(min=0), action_pos], dim=1)


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Pi0's sinusoidal embedding of flow time in [0, 1] (periods from ``min_period`` to ``max_period``)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.double()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


class Pi05Policy(nn.Module):
    """``forward(images, tokens, noisy_actions, time) -> velocity``; see the module docstring.

    :param images: (B, cameras, 3, S, S) in [0, 1].
    :param tokens: (B, text_len + max_state_dim) prompt ids from :func:`~loongforge_embodied.policies.prompt.
        prompt_tokens` (0 = padding, masked out as a key).
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time (1 = pure noise).
    """

    def __init__(self, flavor: Pi05Flavor) -> None:
        super().__init__()
        self.flavor = flavor
        w, e = flavor.width, flavor.expert_width
        self.patch_embed = nn.Conv2d(3, w, flavor.patch_size, stride=flavor.patch_size)
        self.image_pos = nn.Parameter(torch.randn(flavor.cameras, flavor.patches, w) * 0.02)
        self.vision = nn.ModuleList(VisionLayer(flavor) for _ in range(flavor.vision_depth))
        self.token_embed = nn.Embedding(vocab_size(flavor.state_bins), w)
        self.layers = nn.ModuleList(JointLayer(flavor, last=i == flavor.depth - 1) for i in range(flavor.depth))
        self.action_in = nn.Linear(flavor.max_action_dim, e)
        self.time_in = nn.Linear(e, e)
        self.time_out = nn.Linear(e, e)
        self.final_norm = AdaRMSNorm(e, e, flavor.eps, gated=False)
        self.action_out = nn.Linear(e, flavor.max_action_dim)

    def embed_prefix(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix tokens (B, P, width) and their validity (B, P)."""
        batch, cameras = images.shape[:2]
        x = self.patch_embed(images.flatten(0, 1) * 2 - 1).flatten(2).transpose(1, 2)  # SigLIP sees [-1, 1]
        x = x.unflatten(0, (batch, cameras)) + self.image_pos[:cameras]
        x = x.flatten(0, 1)
        for layer in self.vision:
            x = layer(x)
        image_tokens = x.unflatten(0, (batch, cameras)).flatten(1, 2)
        text = self.token_embed(tokens) * math.sqrt(self.flavor.width)  # Gemma scales its embeddings
        valid = torch.cat([tokens.new_ones(image_tokens.shape[:2], dtype=torch.bool), tokens != 0], dim=1)
        return torch.cat([image_tokens, text], dim=1), valid

    def condition(self, time: torch.Tensor) -> torch.Tensor:
        """The adaRMS conditioning vector of flow time ``time`` (B,)."""
        emb = time_embedding(time, self.flavor.expert_width)
        return F.silu(self.time_out(F.silu(self.time_in(emb))))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, noisy_actions: torch.Tensor,
                time: torch.Tensor) -> torch.Tensor:
        prefix, valid = self.embed_prefix(images, tokens)
        horizon = noisy_actions.shape[1]
        actions = self.action_in(noisy_actions)
        cond = self.condition(time)
        mask = joint_mask(valid, horizon)
        angles = self._rope(positions(valid, horizon), prefix.dtype)
        for layer in self.layers:
            prefix, actions = layer(prefix, actions, cond, mask, angles)
        return self.action_out(self.final_norm(actions, cond)[0])

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.flavor.head_dim // 2
        inv = self.flavor.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=pos.device) / half)
        angle = (pos.double()[..., None] * inv)[:, None]
        return angle.cos().to(dtype), angle.sin().to(dtype)
