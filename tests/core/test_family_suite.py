"""The ModelFamilySuite over every decoder family core registers: a tiny flavor of each builds through the one
builder with the device's layers, trains a step, saves and loads, converts to Hugging Face and back bit for bit,
and generates deterministically. A family added to core's tables is covered without touching this file."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loongforge.interop.world import standalone_world
from loongforge.models.decoder_hf import DecoderHFAdapter
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.registration import all_flavors
from loongforge.testing.family_suite import ModelFamilySuite, RecordingCPUBackend

#: Sizes of a decoder that steps in well under a second: 2 layers, 4 heads of 40 (so partial rotary fractions
#: such as Pythia's 0.25 and Phi's 0.4 give whole, even rotary widths).
TINY = dict(num_layers=2, hidden_size=160, ffn_hidden_size=320, num_attention_heads=4, vocab_size=384,
            max_position_embeddings=64)


def tiny_of_each_family() -> dict[str, object]:
    """One tiny flavor per family: the family's smallest registered flavor, shrunk to :data:`TINY` with its kind
    of attention kept (multi-head, multi-query or grouped)."""
    smallest: dict[str, object] = {}
    for flavor in all_flavors().values():
        best = smallest.get(flavor.family)
        if best is None or (flavor.num_layers * flavor.hidden_size) < (best.num_layers * best.hidden_size):
            smallest[flavor.family] = flavor
    tiny = {}
    for family, flavor in sorted(smallest.items()):
        groups = {flavor.num_attention_heads: 4, 1: 1}.get(flavor.num_query_groups, 2)
        sizes = dict(TINY, num_query_groups=groups, head_dim=40 if flavor.head_dim is not None else None)
        if flavor.is_moe:
            sizes.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
            if flavor.moe_shared_expert_intermediate_size:
                sizes["moe_shared_expert_intermediate_size"] = 32
        if flavor.mrope_section is not None:
            sizes["mrope_section"] = (4, 8, 8)
        tiny[family] = flavor.with_overrides(**sizes)
    return tiny


for _family, _flavor in tiny_of_each_family().items():
    _name = "Test" + "".join(part.capitalize() for part in _family.replace(".", "-").split("-")) + "Family"
    globals()[_name] = type(_name, (ModelFamilySuite,), {"family": _flavor, "has_hf_adapter": True})


def test_every_core_family_is_covered():
    """Each family of core's tables has its suite class here (so the loop above cannot silently cover none)."""
    families = {flavor.family for flavor in all_flavors().values()}
    covered = {cls.family.family for name, cls in globals().items()
               if name.startswith("Test") and isinstance(cls, type) and issubclass(cls, ModelFamilySuite)}
    assert families == covered and {"llama", "qwen2", "qwen3", "mixtral", "qwen3-moe"} <= covered


# -- the suite fails families that cannot work -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BypassesTheDevice(DecoderFlavor):
    """Builds its layers on a backend of its own choosing instead of the one it was given."""

    def build_chunk(self, build):
        from loongforge.devices.cpu import CPUBackend

        return dataclasses.replace(build, backend=CPUBackend()).decoder_chunk(self)


@dataclasses.dataclass(frozen=True)
class IgnoresTheSeed(DecoderFlavor):
    """Draws its weights from whatever the global random state is (so layouts and resumes disagree)."""

    def build_chunk(self, build):
        return dataclasses.replace(build, seed=None).decoder_chunk(self)


@dataclasses.dataclass(frozen=True)
class HasADeadParameter(DecoderFlavor):
    """Registers a parameter its forward never uses (it would never train)."""

    def build_chunk(self, build):
        chunk = build.decoder_chunk(self)
        chunk.register_parameter("unused", torch.nn.Parameter(torch.zeros(2, 2)))
        return chunk


@dataclasses.dataclass(frozen=True)
class LosesATensorInConversion(DecoderFlavor):
    """An HF adapter whose ``from_hf`` forgets the final norm."""

    def hf_adapter(self):
        base = DecoderHFAdapter(self)

        class Lossy:
            config_json, to_hf = base.config_json, base.to_hf

            def from_hf(self, tensors):
                return {k: v for k, v in base.from_hf(tensors).items() if k != "decoder.final_layernorm.weight"}

        return Lossy()


LLAMA = all_flavors()["llama-debug"]


@pytest.mark.parametrize(("mutant", "test", "message"), [
    (BypassesTheDevice, "test_builds_through_the_one_builder_deterministically", "never asked the device backend"),
    (IgnoresTheSeed, "test_builds_through_the_one_builder_deterministically", "same seed must draw the same"),
    (HasADeadParameter, "test_training_steps_reach_every_parameter", "no gradient reached"),
    (LosesATensorInConversion, "test_hf_round_trip_is_bitwise", "exactly the model's tensor names"),
])
def test_the_suite_fails_a_family_that_cannot_work(mutant, test, message):
    flavor = mutant(**{f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(DecoderFlavor)})
    suite = type("TestMutant", (ModelFamilySuite,), {"family": flavor, "has_hf_adapter": True})()
    with standalone_world(RecordingCPUBackend()) as world, pytest.raises(AssertionError, match=message):
        getattr(suite, test)(world)
