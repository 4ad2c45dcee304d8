"""The baseline: a Llama-style decoder and training step in plain PyTorch, no framework.

Same architecture and shapes as LoongForge's ``llama-tiny`` (RMSNorm via ``F.rms_norm``, fused QKV,
RoPE, grouped-query attention through ``F.scaled_dot_product_attention`` with ``enable_gqa``, fused
gate/up SwiGLU, untied output layer) and the same optimizer (``torch.optim.AdamW``, foreach) with
gradient clipping, so the benchmark measures the framework's overhead and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, groups: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, dim // heads
        self.attn_norm = RMSNorm(dim, eps)
        self.qkv = nn.Linear(dim, (heads + 2 * groups) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim, eps)
        self.fc1 = nn.Linear(dim, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], dim=-1
        )
        q = apply_rope(q.view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, s, self.groups, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.groups)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, groups: int, ffn: int, seq: int,
                 theta: float = 10000.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, groups, ffn, eps) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(seq, dim // heads, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def train_step(model: PlainLlama, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor,
               grad_clip: float) -> float:
    loss = model(tokens, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
