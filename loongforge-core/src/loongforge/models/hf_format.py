"""A Hugging Face directory read through the family that claims its architecture.

Every crossing from Hugging Face (``model.load: hf:DIR``, ``loongforge convert hf-to-mcore``, ``loongforge check``)
starts here: ``config.json`` is parsed, its ``architectures[0]`` (or, without one, its ``model_type``) is looked up
in the ``hf_architecture`` registry that plugins fill through ``loongforge_register_hf_architectures``, and the
registered :class:`~loongforge.models.family.HFReader` turns it into a model. That model's ``hf_adapter()`` then
checks and reads the tensors. Core's decoder families are registered readers like any plugin's, so core keeps no
table of architectures here.

Torch-free: ``loongforge check`` and name resolution read directories through it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.errors import InteropError, LoongForgeError
from loongforge.models.family import HFReader, ModelFamily

CONFIG_JSON = "config.json"
#: Our precision names <-> the ``torch_dtype`` / ``dtype`` strings of ``config.json``.
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class HFModel:
    """What a Hugging Face directory's ``config.json`` says: the model, the weights' dtype, the raw mapping."""

    family: ModelFamily
    dtype: str  # fp32, bf16 or fp16
    raw: dict[str, Any]
    path: Path


def load_config_json(directory: str | Path) -> tuple[dict[str, Any], Path]:
    """``(mapping, path)`` of ``directory/config.json``; a one-line :class:`InteropError` naming the file otherwise."""
    path = Path(directory).expanduser() / CONFIG_JSON
    if not path.is_file():
        raise InteropError(f"{path}: not found (a Hugging Face checkpoint directory needs a config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InteropError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise InteropError(f"{path}: must hold a JSON object")
    return raw, path


def hf_reader(raw: dict[str, Any], path: Path) -> HFReader:
    """The registered reader of ``raw``'s architecture (``model_type`` when ``architectures`` is absent)."""
    from loongforge.plugins import get_host

    registry = get_host().registry("hf_architecture")
    archs = raw.get("architectures") or []
    if archs and isinstance(archs, list) and isinstance(archs[0], str):
        key, found = archs[0], f"architecture {archs[0]!r}"
    elif isinstance(raw.get("model_type"), str):
        key, found = raw["model_type"], f"model_type {raw['model_type']!r}"
    else:
        raise InteropError(f"{path}: names neither architectures nor model_type; cannot tell which model it is")
    if key not in registry:
        supported = ", ".join(sorted(entry.label for entry in registry.entries()))
        raise InteropError(f"{path}: {found} is not supported; supported: {supported} (a plugin adds one through "
                           "loongforge_register_hf_architectures)")
    return registry.load(key)


def read_hf_model(directory: str | Path) -> HFModel:
    """The model ``directory`` holds, read by the reader its architecture is registered with, and its dtype."""
    raw, path = load_config_json(directory)
    reader = hf_reader(raw, path)
    try:
        family = reader.read_config(raw, path)
    except LoongForgeError as exc:
        message = str(exc)
        raise InteropError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    if family.hf_adapter() is None:
        raise InteropError(f"{path}: the reader of this architecture returned model {family.family_name}, which "
                           "has no hf_adapter() to read its tensors")
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtypes = {v: k for k, v in DTYPE_NAMES.items()}
    if dtype_name not in dtypes:
        raise InteropError(f"{path}: torch_dtype {dtype_name!r} is not supported; use one of {', '.join(dtypes)}")
    return HFModel(family=family, dtype=dtypes[dtype_name], raw=raw, path=path)


def model_differences(actual: ModelFamily, expected: ModelFamily) -> list[str]:
    """``field a != b`` for every field where two models disagree (empty when they describe one model).

    Models of different classes differ as a whole; dataclass models field by field; others by equality.
    """
    if type(actual) is not type(expected):
        return [f"model {type(actual).__name__} != {type(expected).__name__}"]
    if not dataclasses.is_dataclass(actual):
        return [] if actual == expected else [f"model {actual!r} != {expected!r}"]
    return [
        f"{f.name} {getattr(actual, f.name)!r} != {getattr(expected, f.name)!r}"
        for f in dataclasses.fields(actual)
        if getattr(actual, f.name) != getattr(expected, f.name)
    ]
