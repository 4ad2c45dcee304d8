"""A broken model family (MUTANT, tests only) for ``loongforge certify --family``, selected by import path
(``--family mutant_families:SKIPPED_LAYER``; this directory on ``PYTHONPATH``). The suite's own mutants are in
tests/core/test_family_suite.py; this one exercises the command end to end."""

from __future__ import annotations

import dataclasses

from loongforge.models.flavor import DecoderFlavor
from loongforge.models.registration import all_flavors


@dataclasses.dataclass(frozen=True)
class SkipsItsLastLayer(DecoderFlavor):
    """Builds every layer but passes the hidden states around the last one (a layer that never computes)."""

    def build_chunk(self, build):
        chunk = build.decoder_chunk(self)
        last = chunk.decoder.layers[-1]
        last.forward = lambda hidden_states, *args, **kwargs: (hidden_states, None)
        return chunk


SKIPPED_LAYER = SkipsItsLastLayer(**{field.name: getattr(all_flavors()["llama-debug"], field.name)
                                     for field in dataclasses.fields(DecoderFlavor)})
