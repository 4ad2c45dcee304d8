"""What handlers' ``claims(source)`` (:mod:`loongforge.commands`) usually read to tell their sources apart: the model
a LoongForge checkpoint was trained as, and the architecture a Hugging Face directory's ``config.json`` names.

Both are cheap and torch-free, because ``loongforge convert`` and ``loongforge eval`` ask every handler in turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.checkpoint.layout import CONFIG_YAML, CheckpointNotFoundError, locate_checkpoint
from loongforge.config.loader import load_checkpoint_config
from loongforge.models.family import ModelFamily
from loongforge.resolve import resolve_model_flavor


def checkpoint_model(source: str, *, trust_code: bool) -> ModelFamily | None:
    """The model a LoongForge checkpoint ``source`` (a step directory or a checkpoint root) was trained as, or
    ``None`` when ``source`` is no LoongForge checkpoint: what handlers' ``claims`` look at to tell their
    checkpoints apart (an unknown model name in it still raises, naming the plugin that may provide it).
    ``trust_code`` is what the claims received: a ``pkg.module:attr`` model name imports only with it."""
    try:
        path = locate_checkpoint(source)
    except CheckpointNotFoundError:
        return None
    return resolve_model_flavor(load_checkpoint_config(path / CONFIG_YAML, trust_code=trust_code))


def hf_config_names(source: str) -> tuple[str | None, str | None]:
    """``(architectures[0], model_type)`` of the Hugging Face directory ``source`` (Nones when absent or unreadable):
    what converters' ``claims`` look at to tell Hugging Face directories apart."""
    try:
        raw = json.loads((Path(source).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None
    if not isinstance(raw, dict):
        return None, None
    archs = raw.get("architectures") or [None]
    return archs[0], raw.get("model_type")
