"""RoPE in one pass forward and one pass backward, for megatron's unfused (``bshd``) path on CPU.

megatron's ``_apply_rotary_pos_emb_bshd`` computes ``t * cos + rotate_half(t) * sin`` as six kernels (``cos``,
``sin``, two ``mul``, ``neg``/``cat`` for the rotation, ``add``) and then concatenates an empty pass-through part
(a full copy of ``t``) -- in every layer, for the query and the key. Autograd then keeps ``t`` and the rotated copy
alive and accumulates the two gradient paths with an extra ``add_``. On GPU Transformer Engine's fused RoPE replaces
all of it; on CPU, at the tiny Llama benchmark's shape, it was ~5% of the training step.

:class:`RotaryHalves` writes each half of the output with one ``mul`` and one ``addcmul`` and derives the gradient
analytically (the rotation is linear in ``t``), saving only ``cos``/``sin``. The tables of the step's ``freqs``
are computed once and reused by every layer (megatron passes the same tensor to all of them).

Only the cases it covers change: non-interleaved rotation, no multi-latent attention. Those and every other
argument go to megatron's own function, as does tracing under ``torch.compile`` (where Inductor fuses the plain
formula itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loongforge.devices.megatron_cpu.wrapping import replace_once

#: megatron's module whose ``_apply_rotary_pos_emb_bshd`` (looked up by its ``apply_rotary_pos_emb`` and
#: ``apply_rotary_pos_emb_with_cos_sin``) is replaced.
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"


class RotaryHalves(torch.autograd.Function):
    """``y = t * cos + rotate_half(t) * sin`` on the first ``cos.shape[-1]`` channels of ``t``; the rest pass.

    With ``t = [t1, t2]`` (halves of the rotated channels) and ``cos = [c1, c2]``, ``sin = [s1, s2]``:
    ``y1 = t1 * c1 - t2 * s1`` and ``y2 = t2 * c2 + t1 * s2``, so ``dt1 = g1 * c1 + g2 * s2`` and
    ``dt2 = g2 * c2 - g1 * s1``. Nothing assumes ``c1 == c2`` (multimodal RoPE sections may differ).
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1.0), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sign: float) -> torch.Tensor:
    """The forward rotation (``sign`` 1) or its transpose (``sign`` -1, the gradient), into a fresh tensor."""
    rot = cos.shape[-1]
    half = rot // 2
    t1, t2 = t[..., :half], t[..., half:rot]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    first, second = out[..., :half], out[..., half:rot]
    if sign > 0:  # y1 = t1 c1 - t2 s1 ; y2 = t2 c2 + t1 s2
        torch.mul(t1, c1, out=first).addcmul_(t2, s1, value=-1.0)
        torch.mul(t2, c2, out=second).addcmul_(t1, s2)
    else:  # dt1 = g1 c1 + g2 s2 ; dt2 = g2 c2 - g1 s1
        torch.mul(t1, c1, out=first).addcmul_(t2, s2)
        torch.mul(t2, c2, out=second).addcmul_(t1, s1, value=-1.0)
    if rot < t.shape[-1]:  # partial rotary: the rest of the channels pass unchanged (and so do their gradients)
        out[..., rot:] = t[..., rot:]
    return out


class _TableCache:
    """``cos``/``sin`` of the last ``freqs`` seen (with its ``mscale`` and dtype): every layer of a forward pass
    passes megatron's one ``freqs`` tensor, so the tables are computed once per step instead of once per layer."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (freqs, freqs._version, mscale, dtype)
        if self._key is None or not (self._key[0] is freqs and self._key[1:] == key[1:]):
            self._tables = ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
            self._key = key
        assert self._tables is not None
        return self._tables


def fused_bshd(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """megatron's ``_apply_rotary_pos_emb_bshd`` with :class:`RotaryHalves` for the cases it covers."""
    cache = _TableCache()

    def apply_rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                                  multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if rotary_interleaved or multi_latent_attention or torch.compiler.is_compiling():
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        cos, sin = cache.tables(freqs, mscale, t.dtype)
        return RotaryHalves.apply(t, cos, sin)

    return apply_rotary_pos_emb_bshd


def patch_rope_kernel() -> None:
    """Install :func:`fused_bshd` where megatron's RoPE functions look ``_apply_rotary_pos_emb_bshd`` up (once)."""
    replace_once(ROPE_UTILS, "_apply_rotary_pos_emb_bshd", fused_bshd)
