"""The layers Pi0 and Pi0.5 share: a small ViT stand-in for SigLIP, byte-token embeddings, and the joint layers in
which the prefix (VLM) stream and the action expert stream meet in one attention.

The two policies differ only in what they put into the action expert's stream (Pi0: a continuous state token and
time mixed into the action tokens; Pi0.5: the actions alone, time through adaptive RMSNorm) and in its norms, so
:class:`JointPolicy` builds everything else and runs the layers over ``[prefix, suffix]`` with a block-causal
attention mask (see :func:`joint_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


def _norm(width: int, flavor: Any, cond_dim: int | None) -> nn.Module:
    return AdaRMSNorm(width, cond_dim, flavor.eps) if cond_dim else RMSNorm(width, flavor.eps)


class Stream(nn.Module):
    """One stream's weights in a layer: norm + q/k/v in; with ``output``, the attention output projection, a
    second norm and the MLP. The last joint layer's prefix stream has no output (nothing reads it). Norms are
    adaptive (conditioned on a ``cond_dim`` vector) when ``cond_dim`` is given."""

    def __init__(self, width: int, flavor: Any, *, cond_dim: int | None, output: bool) -> None:
        super().__init__()
        inner = flavor.heads * flavor.head_dim
        self.norm1 = _norm(width, flavor, cond_dim)
        self.qkv = nn.Linear(width, 3 * inner, bias=False)
        self.output = output
        if output:
            self.out = nn.Linear(inner, width, bias=False)
            self.norm2 = _norm(width, flavor, cond_dim)
            self.mlp = GatedMLP(width, flavor.mlp_ratio * width)

    def finish(self, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None) -> torch.Tensor:
        """Residual of the attention output, then the MLP block."""
        x = _residual(x, self.out(attended), gate)
        h, gate = self.norm2(x, cond)
        return _residual(x, self.mlp(h), gate)


def _residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads*d) -> (B, heads, N, d)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split pairs) of (B, heads, N, d) with (B, 1, N, d/2) angles."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class VisionLayer(nn.Module):
    """A bidirectional pre-norm transformer layer over one camera's patches (the stand-in for SigLIP)."""

    def __init__(self, flavor: Any) -> None:
        super().__init__()
        self.heads = flavor.heads
        self.stream = Stream(flavor.width, flavor, cond_dim=None, output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.stream.norm1(x)
        q, k, v = (split_heads(t, self.heads) for t in self.stream.qkv(h).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.stream.finish(x, attended, None, None)


class JointLayer(nn.Module):
    """Prefix and expert streams with separate weights and one attention over both (Pi0's mixture of experts)."""

    def __init__(self, flavor: Any, *, last: bool, expert_cond: int | None) -> None:
        super().__init__()
        self.heads = flavor.heads
        self.prefix = Stream(flavor.width, flavor, cond_dim=None, output=not last)
        self.expert = Stream(flavor.expert_width, flavor, cond_dim=expert_cond, output=True)

    def forward(self, prefix: torch.Tensor, suffix: torch.Tensor, cond: torch.Tensor | None, mask: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], *,
                insulated: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Both streams through the layer. ``insulated``: the expert reads only the first ``insulated`` tokens of the
        prefix stream, through stopped gradients (:func:`insulated_attention`); ``None``: one joint attention."""
        hp, gate_p = self.prefix.norm1(prefix)
        hs, gate_s = self.expert.norm1(suffix, cond)
        qkv = torch.cat([self.prefix.qkv(hp), self.expert.qkv(hs)], dim=1)
        q, k, v = (split_heads(t, self.heads) for t in qkv.chunk(3, dim=-1))
        q, k = rotate(q, *rope), rotate(k, *rope)
        n_prefix = prefix.shape[1]
        if insulated is None:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            attended = insulated_attention(q, k, v, mask, backbone=n_prefix, visible=insulated)
        attended = attended.transpose(1, 2).flatten(2)
        suffix = self.expert.finish(suffix, attended[:, n_prefix:], gate_s, cond)
        prefix = self.prefix.finish(prefix, attended[:, :n_prefix], gate_p, None) if self.prefix.output else None
        return prefix, suffix


def insulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, backbone: int,
                        visible: int) -> torch.Tensor:
    """Attention (B, heads, N, d) of knowledge insulation: the first ``backbone`` tokens (the VLM's: prefix, then
    FAST tokens) attend among themselves under ``mask`` (B, 1, N, N); the expert's tokens after them attend to the
    first ``visible`` backbone tokens (the prefix) and to each other, with the backbone's keys and values detached.

    Two attentions, not one: a single one cannot stop the gradient of some queries and not of others. So the flow
    loss trains the expert only, and the expert never reads the FAST tokens (their keys are not among its keys)."""
    out = F.scaled_dot_product_attention(q[:, :, :backbone], k[:, :, :backbone], v[:, :, :backbone],
                                         attn_mask=mask[..., :backbone, :backbone])
    keys = torch.cat([k[:, :, :visible].detach(), k[:, :, backbone:]], dim=2)
    values = torch.cat([v[:, :, :visible].detach(), v[:, :, backbone:]], dim=2)
    expert_mask = torch.cat([mask[..., backbone:, :visible], mask[..., backbone:, backbone:]], dim=-1)
    expert = F.scaled_dot_product_attention(q[:, :, backbone:], keys, values, attn_mask=expert_mask)
    return torch.cat([out, expert], dim=2)


def joint_mask(prefix_valid: torch.Tensor, suffix_blocks: Sequence[int]) -> torch.Tensor:
    """(B, 1, N, N) boolean attention mask (True = may attend) over [prefix, suffix], N = P + len(suffix_blocks).

    The prefix is block 0 and the suffix tokens carry the given (non-decreasing, >= 1) block ids: a query sees
    every valid key of its own and of earlier blocks (openpi's cumulative "ar mask"). So the prefix is
    bidirectional and never depends on the suffix, and can be computed once per observation.
    """
    batch, n_prefix = prefix_valid.shape
    device = prefix_valid.device
    blocks = torch.cat([torch.zeros(n_prefix, dtype=torch.long, device=device),
                        torch.as_tensor(list(suffix_blocks), dtype=torch.long, device=device)])
    key_valid = torch.cat([prefix_valid, prefix_valid.new_ones(batch, len(suffix_blocks))], dim=1)
    allowed = key_valid[:, None, :] & (blocks[None, :] <= blocks[:, None])[None]
    return allowed[:, None]


def positions(prefix_valid: torch.Tensor, suffix_len: int) -> torch.Tensor:
    """(B, N) rotary positions: counting valid prefix tokens, then the suffix right after them."""
    prefix_pos = prefix_valid.long().cumsum(dim=1) - 1
    suffix_pos = prefix_valid.long().sum(dim=1, keepdim=True) + torch.arange(suffix_len, device=prefix_valid.device)
    return torch.cat([prefix_pos.clamp(min=0), suffix_pos], dim=1)


def rope_angles(flavor: Any, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines (B, 1, N, head_dim / 2) of rotary positions ``pos`` (B, N) (``flavor.rope_theta``)."""
    half = flavor.head_dim // 2
    inv = flavor.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=pos.device) / half)
    angle = (pos.double()[..., None] * inv)[:, None]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Pi0's sinusoidal embedding of flow time in [0, 1] (periods from ``min_period`` to ``max_period``)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.double()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


def build_image_tower(module: nn.Module, flavor: Any) -> None:
    """Give ``module`` the image tower (when ``flavor.cameras`` > 0): ``patch_embed``, ``image_pos`` and the
    ``vision`` layers -- attributes, not a submodule, so every policy that has one keeps the same parameter names."""
    if flavor.cameras:
        w = flavor.width
        module.patch_embed = nn.Conv2d(3, w, flavor.patch_size, stride=flavor.patch_size)
        module.image_pos = nn.Parameter(torch.randn(flavor.cameras, flavor.patches, w) * 0.02)
        module.vision = nn.ModuleList(VisionLayer(flavor) for _ in range(flavor.vision_depth))


def embed_images(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, cameras * patches, width) image tokens of (B, cameras, 3, S, S) images in [0, 1], through the tower
    :func:`build_image_tower` gave ``module``."""
    batch, cameras = images.shape[:2]
    x = module.patch_embed(images.flatten(0, 1) * 2 - 1).flatten(2).transpose(1, 2)  # SigLIP sees [-1, 1]
    x = x.unflatten(0, (batch, cameras)) + module.image_pos[:cameras]
    x = x.flatten(0, 1)
    for layer in module.vision:
        x = layer(x)
    return x.unflatten(0, (batch, cameras)).flatten(1, 2)


class JointPolicy(nn.Module):
    """The shared skeleton: image patches (when ``flavor.cameras`` > 0) and byte tokens embedded into the prefix,
    then ``flavor.depth`` joint layers. Subclasses build their expert-side heads after calling this ``__init__``
    (parameter creation order, hence seeded initialisation, stays fixed) and call :meth:`run`.

    ``inputs["images"]``: (B, cameras, 3, S, S) in [0, 1]; ``inputs["tokens"]``: (B, L) ids, 0 = padding
    (masked out as a key, and not counted by the rotary positions).
    """

    def __init__(self, flavor: Any, *, vocab: int, expert_cond: int | None, prefix_output: bool = False) -> None:
        super().__init__()
        self.flavor = flavor
        build_image_tower(self, flavor)
        self.token_embed = nn.Embedding(vocab, flavor.width)
        # ``prefix_output``: the last layer's prefix stream is read too (a language head over it), so it is complete
        self.layers = nn.ModuleList(JointLayer(flavor, last=i == flavor.depth - 1 and not prefix_output,
                                               expert_cond=expert_cond) for i in range(flavor.depth))

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, N, width) embeddings of token ids (B, N), scaled by sqrt(width) as Gemma scales them."""
        return self.token_embed(ids) * math.sqrt(self.flavor.width)

    def embed_prefix(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix tokens (B, P, width) and their validity (B, P): image tokens of every camera, then the tokens."""
        tokens = inputs["tokens"]
        text = self.embed_ids(tokens)
        if not self.flavor.cameras:
            return text, tokens != 0
        image_tokens = embed_images(self, inputs["images"])
        valid = torch.cat([tokens.new_ones(image_tokens.shape[:2], dtype=torch.bool), tokens != 0], dim=1)
        return torch.cat([image_tokens, text], dim=1), valid

    def run(self, prefix: torch.Tensor, valid: torch.Tensor, suffix: torch.Tensor, suffix_blocks: Sequence[int],
            cond: torch.Tensor | None) -> torch.Tensor:
        """The joint layers over ``[prefix, suffix]``; returns the suffix stream (B, len(suffix_blocks), expert)."""
        mask = joint_mask(valid, suffix_blocks)
        angles = rope_angles(self.flavor, positions(valid, suffix.shape[1]), prefix.dtype)
        for layer in self.layers:
            prefix, suffix = layer(prefix, suffix, cond, mask, angles)
        return suffix

    def run_insulated(self, prefix: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor, suffix: torch.Tensor,
                      cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Knowledge insulation's layers over ``[prefix, tokens, suffix]``: ``(the tokens' outputs (B, T, width), the
        suffix stream (B, H, expert))``. ``tokens`` (B, T, width), T >= 0, are embedded discrete actions after the
        prefix: each attends to the prefix and the tokens before it. The suffix attends to the prefix (detached) and
        itself, never to ``tokens``, and its rotary positions follow the prefix as without them, so the expert
        computes the same with T tokens as with none (acting has none)."""
        n_prefix, n_tokens, horizon = prefix.shape[1], tokens.shape[1], suffix.shape[1]
        mask = joint_mask(valid, [*range(1, n_tokens + 1), *[n_tokens + 1] * horizon])
        pos = positions(valid, max(n_tokens, horizon))
        pos = torch.cat([pos[:, :n_prefix + n_tokens], pos[:, n_prefix:n_prefix + horizon]], dim=1)
        angles = rope_angles(self.flavor, pos, prefix.dtype)
        backbone = torch.cat([prefix, tokens], dim=1)
        for layer in self.layers:
            backbone, suffix = layer(backbone, suffix, cond, mask, angles, insulated=n_prefix)
        return backbone[:, n_prefix:], suffix
