"""Gemma-2's "sandwich" norms: attention and MLP outputs normalised before their residual adds.

Gemma-2 adds a norm *after* each sublayer: ``h = x + n2(attn(n1 x))``, ``h + n4(mlp(n3 h))``. Megatron's
``TransformerLayer`` has no slot for either, so a subclass of megatron's ``SelfAttention`` normalises its own
output (``self_attention.post_norm``) and a subclass of the layer normalises the MLP output in megatron's
post-MLP step (``post_mlp_layernorm``); both norms are the device's spec-provider norm class, and every other
module, name and residual add stays megatron's. (The MLP itself stays megatron's ``MLP``, which the layer
builds with its tensor-parallel group.)
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_layer import TransformerLayer


def _post_norm(module: Any, norm: Any) -> Any:
    config = module.config
    return build_module(norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def _normed(norm: Any, output_with_bias: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, None]:
    output, bias = output_with_bias[0], output_with_bias[1]
    return norm(output if bias is None else output + bias), None


class PostNormSelfAttention(SelfAttention):
    """Megatron's self-attention followed by ``post_norm`` (the norm class the spec provider gives)."""

    def __init__(self, *args: Any, post_norm: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.post_norm = _post_norm(self, post_norm)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``(post_norm(attention output + bias), None)``."""
        return _normed(self.post_norm, super().forward(*args, **kwargs))


class PostNormLayer(TransformerLayer):
    """Megatron's sequential layer whose MLP output passes ``post_mlp_layernorm`` before the residual add."""

    def __init__(self, *args: Any, post_norm: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.post_mlp_layernorm = _post_norm(self, post_norm)

    def _forward_post_mlp(self, mlp_output_with_bias: Any, residual: torch.Tensor) -> torch.Tensor:
        return super()._forward_post_mlp(_normed(self.post_mlp_layernorm, mlp_output_with_bias), residual)
