"""Activation recompute for a vision tower's blocks, switched per model part (``encoder_recompute``).

A vision encoder's activations grow with image size and count, independently of the LLM's, so its recompute
setting is its own: with it on, each block keeps only its input during the forward and runs again in the
backward (gradients are bitwise the same). Not a wrapper module, so parameter names -- and with them
checkpoints and Hugging Face conversion -- stay unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, *args: Any, recompute: bool,
               after: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """``x`` through every block (``block(x, *args)``), recomputed in the backward when ``recompute`` is set;
    ``after(index, x)`` sees each block's output (Qwen3-VL's DeepStack taps intermediate blocks)."""
    for index, block in enumerate(blocks):
        if recompute and torch.is_grad_enabled():
            x = checkpoint(block, x, *args, use_reentrant=False)
        else:
            x = block(x, *args)
        if after is not None:
            after(index, x)
    return x
