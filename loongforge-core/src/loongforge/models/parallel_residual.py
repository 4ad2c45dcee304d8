"""A megatron ``TransformerLayer`` whose attention and MLP read the same input (GPT-NeoX, Phi-2, GPT-J).

Megatron-core's layer is sequential: ``h = x + attn(n1 x)``, then ``h + mlp(n2 h)``. The parallel forms feed
the MLP the layer *input* instead, ``x + attn(n1 x) + mlp(n2 x)`` (GPT-NeoX's ``use_parallel_residual``), or
with one shared norm, ``x + attn(n x) + mlp(n x)`` (Phi-2). Only ``forward`` changes: the submodules, their
names and the device's spec-provider modules are the megatron layer's own, so checkpoints, sharding and the
fused norm+linear (Transformer Engine) modules work as for a sequential layer. The shared-norm form applies
``input_layernorm`` to ``x`` a second time for the MLP rather than caching it across megatron's attention
helper; it is the same module and weight, so the result and the gradients are those of one shared norm.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer


class ParallelResidualLayer(TransformerLayer):
    """``x + attn(n1 x) + mlp(n2 x)``; with ``shared_norm``, ``n2`` is ``input_layernorm`` itself."""

    def __init__(self, *args: Any, shared_norm: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_norm = shared_norm

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Megatron's layer interface: ``(output, context)`` for the ``[s, b, h]`` input."""
        kwargs.pop("dynamic_inference_decode_only", None)
        with_attention, context = self._forward_attention(hidden_states, *args, **kwargs)  # x + attn(n1 x)
        if self.shared_norm:
            mlp_input = self.input_layernorm(hidden_states)
        else:
            mlp_input = self._forward_pre_mlp_layernorm(hidden_states)
        if self.recompute_mlp:
            mlp_output = tensor_parallel.checkpoint(self.mlp, False, mlp_input)
        else:
            mlp_output = self.mlp(mlp_input)
        return self._forward_post_mlp(mlp_output, with_attention), context
