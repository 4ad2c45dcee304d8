"""Loading a trained task model (see :mod:`loongforge.tasks`) back from its checkpoint, for ``loongforge sample``,
policy evaluation and serving.

Training itself is the one loop (:mod:`loongforge.train.loop`) over the task engine
(:mod:`loongforge.train.engines.task`), which documents the checkpoint's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from loongforge.checkpoint.layout import CONFIG_YAML, find_checkpoint
from loongforge.errors import ConfigError


def load_task_model(checkpoint: str | Path, *, trust_code: bool = False) -> tuple[Any, Any, Path]:
    """``(task, model, checkpoint dir)`` from a task checkpoint (or a checkpoint root's ``latest``), verified.

    The task's own state (``state.pt``, e.g. a policy's normaliser and dimensions) is restored too, so the task
    can use the model at once without rebuilding its dataset. Nothing here unpickles (safetensors, and
    ``torch.load(weights_only=True)``); a ``pkg.module:attr`` model name in the checkpoint's config imports its
    module only with ``trust_code`` (the user's ``--trust-code``)."""
    from loongforge.config.loader import load_checkpoint_config
    from loongforge.plugins import get_host
    from loongforge.resolve import registered_family

    path = find_checkpoint(checkpoint)
    config = load_checkpoint_config(path / CONFIG_YAML, trust_code=trust_code)
    family = registered_family(config, get_host())
    if family.engine != "task":
        raise ConfigError(f"{path}: model '{config.model.name}' is not a task model (use `loongforge generate`)")
    task = family.make_task(config)
    torch.manual_seed(config.run.seed)
    model = task.build_model()
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    if (path / "state.pt").is_file():
        task.load_state_dict(torch.load(path / "state.pt", weights_only=True)["task"])
    return task, model.eval(), path
