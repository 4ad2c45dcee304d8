"""RMSNorm/LayerNorm for megatron layer specs that works with sequence parallelism, using torch's fused ops.

Megatron's ``WrappedTorchNorm`` (the local-spec norm) asserts ``not config.sequence_parallel``: with sequence
parallelism each tensor-parallel rank normalises a different slice of the sequence, so the norm weights'
gradients differ per rank and must be summed, and megatron only sums parameters tagged
``sequence_parallel=True`` -- which only the Apex and Transformer Engine norms do. This norm tags its
parameters, so ``finalize_model_grads`` all-reduces them across the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
