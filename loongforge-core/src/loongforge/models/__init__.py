"""LLM families on megatron-core: flavor tables (torch-free), the model-family contract and the model builder.

Importing this package is cheap: flavors are plain dataclasses. ``loongforge.models.decoder_model``,
``loongforge.models.chunks`` (the one builder, :class:`~loongforge.models.chunks.ChunkBuild`) and
``loongforge.models.hf_adapter`` import torch and megatron when a run builds a model.

What a model-family plugin uses (docs/plugin-authors.md): :class:`ModelFamily` (the contract every registered
model implements), :class:`DecoderFlavor` (a megatron decoder described by data), :class:`HFAdapter` and core's
:class:`DecoderHFAdapter`, :class:`HFReader` (registered per Hugging Face architecture); for a family's own layers,
``loongforge.models.chunks.DecoderSpec``.
"""

from __future__ import annotations

from loongforge.models.decoder_hf import DecoderHFAdapter
from loongforge.models.family import HFAdapter, HFReader, ModelFamily, check_family
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.registration import all_flavors, register_builtin_models

__all__ = ["DecoderFlavor", "DecoderHFAdapter", "HFAdapter", "HFReader", "ModelFamily", "all_flavors", "check_family",
           "register_builtin_models"]
