"""LLM families on megatron-core: flavor tables (torch-free) and the model builder.

Importing this package is cheap: flavors are plain dataclasses. ``loongforge.models.builder`` and
``loongforge.models.hf_adapter`` import torch and megatron when a run builds a model.
"""

from __future__ import annotations

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.registration import all_flavors, register_builtin_models

__all__ = ["DecoderFlavor", "all_flavors", "register_builtin_models"]
