"""DeepStack (Qwen3-VL): vision features added to the hidden states of the first decoder layers.

Besides the tokens that replace the image placeholders, a Qwen3-VL encoder gives one more feature per placeholder
for each of its DeepStack blocks; decoder layer ``i`` adds the ``i``-th set to its output at the placeholder
positions (transformers' ``Qwen3VLTextModel._deepstack_process``). Megatron's ``TransformerBlock`` runs its layers
in a loop with no per-layer input, so the addition is a forward hook on each of the first layers: the model, having
embedded a batch, stores one dense residual per layer -- the features at the placeholder positions, zeros
elsewhere, in the decoder's ``[seq, batch, hidden]`` layout and already scattered like the hidden states under
sequence parallelism -- and the hook adds it to the layer's output. Adding zeros leaves the other positions
exactly as they were, and the same code serves any tensor-parallel size with or without sequence parallelism.

What it cannot serve is refused before a model is built (:meth:`VLMFlavor.check_layout`,
:func:`check_recompute`): pipeline stages after the first hold no vision features, context parallelism splits the
sequence the residuals are laid out over, and full-layer recompute re-runs the hook inside megatron's re-entrant
checkpoint, whose nested backward would free the encoder's graph before the embedding's path reaches it.
"""

from __future__ import annotations

from typing import Any

import torch
from loongforge.errors import LoongForgeError
from torch import nn


class DeepStackInjection:
    """Forward hooks adding :attr:`residuals` ``[level]`` to the output of decoder layer ``level``.

    :attr:`residuals` is set by every forward pass of the model (``None`` for a batch without images, when the
    hooks add nothing) and kept until the next, so the backward of the same micro-batch sees the same tensors.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.residuals: list[torch.Tensor] | None = None
        for level, layer in enumerate(layers):
            layer.register_forward_hook(self._adder(level))

    def _adder(self, level: int) -> Any:
        def add(module: nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
            if self.residuals is None:
                return output
            hidden, context = output
            return hidden + self.residuals[level].to(hidden.dtype), context

        return add


def check_recompute(config: Any) -> None:
    """Refuse full-layer recompute for a model with DeepStack (see the module docstring), in one line."""
    if getattr(config, "recompute_granularity", None) == "full":
        raise LoongForgeError("model.recompute granularity 'full' is not supported with Qwen3-VL's DeepStack (its "
                              "layers take vision features from outside the recomputed region); use granularity "
                              "'selective' or encoder_recompute")
