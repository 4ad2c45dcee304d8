"""One Qwen-Image double-stream (MMDiT) block: image and text keep their own weights and meet only in attention.

Each stream has its own AdaLN modulation (shift/scale/gate for attention and for the FFN, six vectors computed
from the time embedding), its own fused q/k/v projection with per-head RMSNorm on queries and keys, its own output
projection and GELU FFN. Attention is one joint softmax over ``[text tokens, image tokens]``: every token sees
every unmasked token of both modalities, with the multimodal RoPE applied to each stream's queries and keys.

The fused ``qkv`` runs one GEMM instead of three per stream; the diffusers converter splits and joins it bitwise.
For tensor parallelism ``qkv``/``ffn.fc1`` become column-parallel and ``out``/``ffn.fc2`` row-parallel; the
q/k norms are per head, so they need no cross-rank reduction (unlike Wan's across-heads norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_diffusion.qwen_image.embeddings import FloatRMSNorm
from loongforge_diffusion.qwen_image.flavors import FFN_MULT, NORM_EPS
from loongforge_diffusion.wan.block import FeedForward, modulate
from loongforge_diffusion.wan.norms import FloatLayerNorm
from loongforge_diffusion.wan.rope import apply_rope


class Stream(nn.Module):
    """One modality's half of a block; :class:`JointBlock` runs the attention between the two halves."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.modulation = nn.Linear(dim, 6 * dim)
        self.norm_attn = FloatLayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = FloatRMSNorm(head_dim, eps=NORM_EPS)
        self.norm_k = FloatRMSNorm(head_dim, eps=NORM_EPS)
        self.out = nn.Linear(dim, dim)
        self.norm_ffn = FloatLayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ffn = FeedForward(dim, FFN_MULT * dim)

    def modulation_vectors(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``temb (B, dim)`` -> shift, scale, gate (attention), shift, scale, gate (FFN), each ``(B, 1, dim)``."""
        return self.modulation(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)

    def attention_inputs(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                         rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Modulated norm, q/k/v as ``(B, S, heads, head_dim)``, q/k normalised per head and rotated."""
        q, k, v = self.qkv(modulate(self.norm_attn, x, shift, scale)).chunk(3, dim=-1)
        heads = (self.num_heads, -1)
        q = apply_rope(self.norm_q(q.unflatten(-1, heads)), rope)
        k = apply_rope(self.norm_k(k.unflatten(-1, heads)), rope)
        return q, k, v.unflatten(-1, heads)

    def finish(self, x: torch.Tensor, attended: torch.Tensor, gate_attn: torch.Tensor, shift: torch.Tensor,
               scale: torch.Tensor, gate_ffn: torch.Tensor) -> torch.Tensor:
        """Gated residual of the attention output, then the gated residual of the modulated FFN."""
        x = x + gate_attn * self.out(attended)
        return x + gate_ffn * self.ffn(modulate(self.norm_ffn, x, shift, scale))


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, S, H, D)`` inputs, ``mask (B, 1, 1, S)`` boolean over keys (``True`` = attend) -> ``(B, S, H*D)``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


class JointBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.img = Stream(dim, num_heads, head_dim)
        self.txt = Stream(dim, num_heads, head_dim)

    def forward(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, image_rope: torch.Tensor,
                text_rope: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``image (B, N, dim)``, ``text (B, L, dim)``, ``temb (B, dim)`` -> updated ``(image, text)``."""
        img_shift, img_scale, img_gate, *img_ffn = self.img.modulation_vectors(temb)
        txt_shift, txt_scale, txt_gate, *txt_ffn = self.txt.modulation_vectors(temb)
        img_qkv = self.img.attention_inputs(image, img_shift, img_scale, image_rope)
        txt_qkv = self.txt.attention_inputs(text, txt_shift, txt_scale, text_rope)
        q, k, v = (torch.cat(pair, dim=1) for pair in zip(txt_qkv, img_qkv, strict=True))
        txt_out, img_out = joint_attention(q, k, v, mask).split([text.shape[1], image.shape[1]], dim=1)
        return self.img.finish(image, img_out, img_gate, *img_ffn), self.txt.finish(text, txt_out, txt_gate, *txt_ffn)
