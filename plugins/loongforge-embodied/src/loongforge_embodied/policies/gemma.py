"""Gemma's layers exactly as PaliGemma and Pi0.5's action expert compute them, in plain torch.

- :class:`GemmaRMSNorm`: ``x / rms(x) * (1 + weight)`` in float32 (the weight is stored around 0), or, with a
  conditioning width, Pi0.5's adaptive RMSNorm: ``Linear(cond) -> (scale, shift, gate)``,
  ``x / rms(x) * (1 + scale) + shift``, and the gate scales the residual branch (``x + y * gate``).
- :class:`GemmaLayer`: one stream's weights in a layer (norms, q/k/v/o without biases, grouped-query heads,
  the gated GELU(tanh) MLP); the attention itself is joint (:func:`joint_attention`), over every stream's tokens.
- :func:`rotary` / :func:`joint_attention`: Gemma's rotate-half RoPE (angles in float32) and softmax attention
  with an additive mask, keys and values repeated per query-head group as transformers' ``repeat_kv`` does.

Parameter names are kept close to transformers' Gemma (``q_proj``, ``mlp.gate_proj``, ...) so that the LeRobot /
OpenPI conversion (:mod:`loongforge_embodied.convert_lerobot`) is a rename.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: The additive mask value LeRobot/OpenPI use for a masked key (finite, so a row with no key stays finite).
MASKED = -2.3819763e38


class GemmaRMSNorm(nn.Module):
    """``forward(x, cond=None) -> (normed, gate)``; see the module docstring. ``gate`` is ``None`` unless adaptive."""

    def __init__(self, dim: int, eps: float, cond_dim: int | None = None) -> None:
        super().__init__()
        self.eps, self.cond_dim = eps, cond_dim
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:  # zero-initialised (openpi): scale 1, shift 0, gate 0, so an expert layer starts as the identity
            self.dense = nn.Linear(cond_dim, 3 * dim)
            nn.init.zeros_(self.dense.weight)
            nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cond_dim is None:
            return (normed * (1.0 + self.weight.float())).type_as(x), None
        scale, shift, gate = self.dense(cond)[:, None].chunk(3, dim=-1)
        return (normed * (1.0 + scale.float()) + shift.float()).type_as(x), gate.type_as(x)


class GemmaMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def _residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class GemmaLayer(nn.Module):
    """One stream's weights in one decoder layer. :meth:`qkv` opens the layer (norm, projections, heads first),
    :meth:`finish` closes it from the stream's slice of the joint attention output."""

    def __init__(self, width: int, mlp_dim: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 cond_dim: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = GemmaRMSNorm(width, eps, cond_dim)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.post_attention_layernorm = GemmaRMSNorm(width, eps, cond_dim)
        self.mlp = GemmaMLP(width, mlp_dim)

    def qkv(self, x: torch.Tensor, cond: torch.Tensor | None, *, queries: bool = True
            ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q (B, heads, L, d), k, v (B, kv_heads, L, d), gate)`` of the stream's tokens ``x`` (B, L, width);
        ``q`` is None without ``queries`` (tokens that only serve as keys)."""
        h, gate = self.input_layernorm(x, cond)
        batch, length = x.shape[:2]

        def heads(proj: nn.Linear, n: int) -> torch.Tensor:
            return proj(h).view(batch, length, n, self.head_dim).transpose(1, 2)

        k, v = heads(self.k_proj, self.kv_heads), heads(self.v_proj, self.kv_heads)
        return heads(self.q_proj, self.heads) if queries else None, k, v, gate

    def finish(self, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None) -> torch.Tensor:
        """The layer's output from its input ``x`` and the stream's attention output (B, L, heads * head_dim)."""
        x = _residual(x, self.o_proj(attended), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        return _residual(x, self.mlp(h), gate)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Gemma's RoPE of ``x`` (B, heads, L, d) at integer ``positions`` (B, L): rotate-half pairs (i, i + d/2)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device).float() / dim))
    angles = positions.float()[:, :, None] * inv_freq[None, None]
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def joint_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], positions: torch.Tensor,
                    mask: torch.Tensor, theta: float, *, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the streams' tokens concatenated in order: (B, Q, heads * d) for the Q query tokens.

    :param positions: (B, L) rotary positions of the keys; ``query_positions`` those of the queries when they are
        not all L tokens (the default). ``mask``: (B, Q, L) bool, True where a query may see a key.
    """
    q, k, v = (torch.cat(parts, dim=2) for parts in (qs, ks, vs))
    q = rotary(q, positions if query_positions is None else query_positions, theta)
    k = rotary(k, positions, theta)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, MASKED)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def prefix_lm_mask(pad: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(B, L, L) bool: a query sees a key when both are real (``pad`` True) and the key's block (the running count
    of ``blocks`` starts, 1 where a new block begins) is not later than the query's (big_vision's prefix-LM)."""
    cumsum = torch.cumsum(blocks.long(), dim=1)
    return (cumsum[:, None, :] <= cumsum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
