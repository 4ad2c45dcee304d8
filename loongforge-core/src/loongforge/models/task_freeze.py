"""``model.freeze`` on a task-engine model: one plain torch module, whole on every rank.

Why its own function: core's megatron path (:func:`loongforge.models.lora.apply_adapters`) walks model *chunks* with
megatron's layer numbering and counts parameters through megatron's parallel groups, which a task model has none
of -- freezing a diffusion DiT's blocks went down that path and ended in ``TypeError: 'WanModel' object is not
iterable``. Here the names are the module's own ``named_parameters()``. ``check`` has already refused a pattern that
matches every name (:mod:`loongforge.train.preflight`); what only the built module can tell -- a pattern that
matches no parameter, patterns that together leave nothing to train -- is one line right after the module is built,
before its data, optimizer or strategy exist.
"""

from __future__ import annotations

import fnmatch

import torch.distributed as dist
from torch import nn

from loongforge.errors import ConfigError


def freeze_task_model(model: nn.Module, patterns: list[str], where: str) -> None:
    """Freeze the parameters of ``model`` whose names match any glob of ``patterns``; a pattern that matches none,
    or a freeze that leaves nothing to train, is a :class:`ConfigError` naming ``where`` (the config's origin)."""
    named = list(model.named_parameters())
    names = [name for name, _ in named]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(f"{where}: model.freeze pattern '{pattern}' matches no parameter of the model (its "
                              f"names look like {names[0]}, {names[-1]})")
    for name, param in named:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    total = sum(p.numel() for _, p in named)
    if trainable == 0:
        raise ConfigError(f"{where}: model.freeze {patterns} freezes every parameter of the model: nothing would "
                          "train (name the parts to freeze)")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[loongforge] trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})", flush=True)
