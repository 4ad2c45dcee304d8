"""An exponential moving average of a model's trainable parameters, for sampling with smoother weights.

After each optimizer step ``ema.update(model)`` sets ``shadow = d * shadow + (1 - d) * param`` with
``d = decay``, or with ``warmup`` ``d = min(decay, (1 + n) / (10 + n))`` where n counts earlier updates, so
the average is not dominated by the random initial weights early in training. Only parameters that require a
gradient at construction are tracked (with LoRA: just the adapters), kept in float32 by default so that a
bf16 model's tiny per-step increments are not rounded away. Each data-parallel rank averages the parameters it
holds, so sharded parameters (FSDP, distributed optimizer) need no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from loongforge.errors import ConfigError, LoongForgeError
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, *, decay: float = 0.9999, warmup: bool = False,
                 dtype: torch.dtype | None = torch.float32) -> None:
        """:param dtype: the shadow copies' dtype; ``None`` keeps each parameter's own."""
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"ema: decay must lie in [0, 1), got {decay}")
        self.decay, self.warmup, self.num_updates = decay, warmup, 0
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().to(dtype=dtype or p.dtype, copy=True)
            for name, p in model.named_parameters() if p.requires_grad
        }

    def current_decay(self) -> float:
        """The ``d`` the next :meth:`update` uses."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    def _tracked(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        missing = [name for name in self.shadow if name not in params]
        if missing:
            raise LoongForgeError(f"ema: the model has no parameter '{missing[0]}' that this EMA tracks")
        return [params[name] for name in self.shadow]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the current parameters into the average; call once after each optimizer step."""
        d = self.current_decay()
        shadows = list(self.shadow.values())
        params = [p.detach().to(s.dtype) for p, s in zip(self._tracked(model), shadows, strict=True)]
        torch._foreach_mul_(shadows, d)
        torch._foreach_add_(shadows, params, alpha=1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's tracked parameters with the averages (cast to each parameter's dtype)."""
        for param, shadow in zip(self._tracked(model), self.shadow.values(), strict=True):
            param.copy_(shadow)

    @contextmanager
    def swap(self, model: nn.Module) -> Iterator[nn.Module]:
        """``with ema.swap(model):`` the model holds the averages inside the block, and exactly its training
        weights again after it (they are kept aside, not recovered from a lossy cast)."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self._tracked(model)]
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for param, original in zip(self._tracked(model), kept, strict=True):
                    param.copy_(original)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "warmup": self.warmup, "num_updates": self.num_updates,
                "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the tracked names and shapes must match this EMA's."""
        shadow = state["shadow"]
        if sorted(shadow) != sorted(self.shadow):
            odd = sorted(set(shadow) ^ set(self.shadow))[0]
            where = "has" if odd in shadow else "lacks"
            raise LoongForgeError(f"ema: the saved average {where} parameter '{odd}', unlike this model's")
        for name, tensor in shadow.items():
            if tensor.shape != self.shadow[name].shape:
                raise LoongForgeError(f"ema: saved '{name}' has shape {list(tensor.shape)}, "
                                      f"the model's is {list(self.shadow[name].shape)}")
            self.shadow[name].copy_(tensor)
        self.decay, self.warmup, self.num_updates = float(state["decay"]), bool(state["warmup"]), \
            int(state["num_updates"])
