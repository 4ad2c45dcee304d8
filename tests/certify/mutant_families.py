"""Broken model families (MUTANTS, tests only) for ``loongforge certify --family``, selected by import path
(``--family mutant_families:DEAD_PARAMETER``; this directory on ``PYTHONPATH``): llama-debug with one fault each."""

from __future__ import annotations

import dataclasses

import torch
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.registration import all_flavors


@dataclasses.dataclass(frozen=True)
class HasADeadParameter(DecoderFlavor):
    """Registers a parameter its forward never uses (it would never train)."""

    def build_chunk(self, build):
        chunk = build.decoder_chunk(self)
        chunk.register_parameter("unused", torch.nn.Parameter(torch.zeros(2, 2)))
        return chunk


@dataclasses.dataclass(frozen=True)
class DropsTheTiedHead(DecoderFlavor):
    """Says its output layer is the embedding but builds an output layer of its own."""

    def build_chunk(self, build):
        return build.decoder_chunk(dataclasses.replace(self, tie_word_embeddings=False))


_LLAMA = {field.name: getattr(all_flavors()["llama-debug"], field.name) for field in dataclasses.fields(DecoderFlavor)}
DEAD_PARAMETER = HasADeadParameter(**_LLAMA)
UNTIED_HEAD = DropsTheTiedHead(**{**_LLAMA, "tie_word_embeddings": True})
