"""RMSNorm/LayerNorm for megatron layer specs that works with sequence parallelism, using torch's fused ops.

Megatron's ``WrappedTorchNorm`` (the local-spec norm) asserts ``not config.sequence_parallel``: with sequence
parallelism each tensor-parallel rank normalises a different slice of the sequence, so the norm weights'
gradients differ per rank and must be summed, and megatron only sums parameters tagged
``sequence_parallel=True`` -- which only the Apex and Transformer Engine norms do. This norm tags its
parameters, so ``finalize_model_grads`` all-reduces them across the tensor-parallel group.

RMSNorm's backward is :class:`RMSNormFunction`'s: torch has a fused RMSNorm forward on CPU but differentiates it as
a dozen elementwise kernels; written out analytically it is six, ~30% less time for the norms of the tiny Llama
benchmark's step (nine per step). The forward stays torch's fused kernel, so outputs are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

#: torch's fused RMSNorm returning the per-row ``1/rms`` too (absent before torch 2.8: F.rms_norm is used then).
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)


class RMSNormFunction(torch.autograd.Function):
    """``y = x * r * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` over the last dimension.

    With ``xhat = x * r`` and ``gw = g * w``: ``dw = sum(g * xhat)`` over the rows and
    ``dx = r * (gw - xhat * mean(gw * xhat))``. Saves the input and ``r`` (one value per row).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _FUSED_RMS_NORM(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_weight = (grad * normed).sum(tuple(range(grad.dim() - 1)))
        grad_normed = grad * weight
        mean_dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_normed, normed, mean_dot, value=-1).mul_(rstd)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: :class:`RMSNormFunction` in eager fp32/fp64, else ``F.rms_norm``.

    Under ``torch.compile`` Inductor fuses ``F.rms_norm`` and its gradient itself; 16-bit inputs keep torch's
    (which accumulates in fp32 and casts back).
    """
    if (_FUSED_RMS_NORM is None or torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.float64)
            or weight.dtype != x.dtype):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


class SPNorm(MegatronModule):
    """``config.normalization`` ("RMSNorm" or "LayerNorm") over the last dimension, SP-aware.

    Constructor arguments match megatron's norm modules (``TENorm``, ``FusedLayerNorm``). Zero-centred
    gamma (weight stored as ``gamma - 1``) is supported because it is one addition.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        super().__init__(config=config)
        self.normalization = config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"SPNorm supports RMSNorm and LayerNorm, not {self.normalization}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=config.params_dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            if self.normalization == "LayerNorm"
            else None
        )
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "RMSNorm":
            return rms_norm(x, weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
