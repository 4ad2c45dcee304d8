"""Activation checkpointing for policies (``task.recompute: true``): keep each layer's input, not its internals.

A policy's layers are the members of its ``nn.ModuleList`` containers (the joint/Gemma layers, the vision layers,
GR00T's backbone, adapter and DiT blocks), so one rule serves every family without each naming its layers. The
layer's ``forward`` is replaced on the instance by a non-reentrant :func:`torch.utils.checkpoint.checkpoint` of
the original: parameter names and checkpoints stay as they are (a ``checkpoint_wrapper`` module would rename every
parameter), hooks that FSDP2 and DDP install on ``__call__`` still run, and the recomputed backward gives the same
gradients as the stored one.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute every layer of ``model`` in backward; returns how many layers were switched."""
    count = 0
    for container in model.modules():
        if isinstance(container, nn.ModuleList):
            for layer in container:
                layer.forward = _recomputed(layer.forward)
                count += 1
    return count


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
