"""The ModelFamilySuite over every decoder family core registers: a tiny flavor of each builds through the one
builder with the device's layers, trains a step, saves and loads, converts to Hugging Face and back bit for bit,
and generates deterministically. A family added to core's tables is covered without touching this file."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import ClassVar

import pytest
import torch
from loongforge.config.sections import ranged
from loongforge.interop.world import standalone_world
from loongforge.models.decoder_hf import DecoderHFAdapter
from loongforge.models.family import ModelFamily
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
        if flavor.embedding_multiplier is not None:  # Gemma's sqrt(hidden_size), which its format hard-codes
            sizes["embedding_multiplier"] = TINY["hidden_size"] ** 0.5
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


class _WrappedAdapter:
    """Core's adapter with ``to_hf``/``from_hf`` rewritten by a mutant (each inverting the other, so the round trip
    alone cannot see it)."""

    def __init__(self, flavor, to_hf, from_hf):
        self.base, self._to, self._from = DecoderHFAdapter(flavor), to_hf, from_hf

    def config_json(self, dtype, base=None):
        return self.base.config_json(dtype, base)

    def to_hf(self, state):
        return self._to(self.base.to_hf(state))

    def from_hf(self, tensors, **options):
        return self.base.from_hf(self._from(tensors), **options)


@dataclasses.dataclass(frozen=True)
class RenamesNothing(DecoderFlavor):
    """An "adapter" that writes the model's own tensor names and reads them back: a perfect round trip of a file
    no other program reads."""

    def hf_adapter(self):
        flavor = self

        class Identity:
            def config_json(self, dtype, base=None):
                return DecoderHFAdapter(flavor).config_json(dtype, base)

            def to_hf(self, state):
                return dict(state)

            def from_hf(self, tensors, **options):
                return dict(tensors)

        return Identity()


def _swap(tensors, a, b):
    """``tensors`` with every ``...a...`` and ``...b...`` tensor exchanged."""
    out = dict(tensors)
    for name in tensors:
        if a in name:
            other = name.replace(a, b)
            out[name], out[other] = tensors[other], tensors[name]
    return out


@dataclasses.dataclass(frozen=True)
class SwapsGateAndUp(DecoderFlavor):
    """Writes the MLP's gate projection as its up projection and back."""

    def hf_adapter(self):
        swap = functools.partial(_swap, a=".mlp.gate_proj.", b=".mlp.up_proj.")
        return _WrappedAdapter(self, swap, swap)


def _reverse_head_rows(tensors, heads_of):
    """Query and key rows reversed within each head (another rotary channel order, its own inverse)."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        for projection, heads in heads_of.items():
            if name.endswith(f"self_attn.{projection}.weight"):
                out[name] = tensor.view(heads, -1, tensor.shape[-1]).flip(1).reshape(tensor.shape)
    return out


@dataclasses.dataclass(frozen=True)
class WritesAnotherRopeLayout(DecoderFlavor):
    """Stores the rotary channels of queries and keys in another order than the reference reads."""

    def hf_adapter(self):
        flip = functools.partial(_reverse_head_rows, heads_of={"q_proj": self.num_attention_heads,
                                                              "k_proj": self.num_query_groups})
        return _WrappedAdapter(self, flip, flip)


@dataclasses.dataclass(frozen=True)
class UsesMegatronsLocalLayers(DecoderFlavor):
    """Asks the device for its layers, then builds with megatron's local ones anyway."""

    def build_chunk(self, build):
        from megatron.core.models.backends import LocalSpecProvider

        build.backend.spec_provider()

        class Local(type(build.backend)):
            def spec_provider(self):
                return LocalSpecProvider()

        return dataclasses.replace(build, backend=Local()).decoder_chunk(self)


@dataclasses.dataclass(frozen=True)
class DropsTheTiedHead(DecoderFlavor):
    """Says its output layer is the embedding (``tie_word_embeddings``) but builds an output layer of its own, which
    then trains apart from the embedding."""

    mutant_fields: ClassVar[dict] = {"tie_word_embeddings": True}

    def build_chunk(self, build):
        return build.decoder_chunk(dataclasses.replace(self, tie_word_embeddings=False))


LLAMA = all_flavors()["llama-debug"]


@pytest.mark.parametrize(("mutant", "test", "message"), [
    (BypassesTheDevice, "test_builds_through_the_one_builder_deterministically", "never asked the device backend"),
    (IgnoresTheSeed, "test_builds_through_the_one_builder_deterministically", "same seed must draw the same"),
    (HasADeadParameter, "test_training_steps_reach_every_parameter", "no gradient reached"),
    (LosesATensorInConversion, "test_hf_round_trip_is_bitwise", "exactly the model's tensor names"),
    (UsesMegatronsLocalLayers, "test_builds_through_the_one_builder_deterministically",
     "not built from the device's spec provider"),
    (RenamesNothing, "test_hf_export_computes_what_the_model_computes", "does not load into transformers' Llama"),
    (SwapsGateAndUp, "test_hf_export_computes_what_the_model_computes", "computes other logits"),
    (WritesAnotherRopeLayout, "test_hf_export_computes_what_the_model_computes", "computes other logits"),
    (DropsTheTiedHead, "test_hf_export_computes_what_the_model_computes", "computes other logits"),
])
def test_the_suite_fails_a_family_that_cannot_work(mutant, test, message, tmp_path):
    fields = {f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(DecoderFlavor)}
    flavor = mutant(**{**fields, **getattr(mutant, "mutant_fields", {})})
    suite = type("TestMutant", (ModelFamilySuite,), {"family": flavor, "has_hf_adapter": True})()
    check = getattr(suite, test)
    extra = (tmp_path,) if "tmp_path" in inspect.signature(check).parameters else ()
    with standalone_world(RecordingCPUBackend()) as world, pytest.raises(AssertionError, match=message):
        check(world, *extra)


@pytest.mark.parametrize("mutant", [RenamesNothing, SwapsGateAndUp, WritesAnotherRopeLayout])
def test_the_round_trip_alone_cannot_see_these_adapters(mutant):
    """Why the reference check exists: each mutant above inverts itself, so to_hf -> from_hf -> to_hf is bitwise."""
    flavor = mutant(**{f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(DecoderFlavor)})
    suite = type("TestMutant", (ModelFamilySuite,), {"family": flavor, "has_hf_adapter": True})()
    with standalone_world(RecordingCPUBackend()) as world:
        suite.test_hf_round_trip_is_bitwise(world)


@dataclasses.dataclass(frozen=True)
class _UnrangedSample:
    steps: int = 20
    guidance: float | None = ranged(None, low=0)


@dataclasses.dataclass(frozen=True)
class _UnrangedOptions:
    samples: int = ranged(8, low=1)
    sample: _UnrangedSample | None = None


class LeavesAnOptionUnranged(ModelFamily):
    """A task family one of whose numbers (nested, in an optional section) declares no range."""

    engine = "task"
    task_options = _UnrangedOptions


def test_the_suite_fails_a_task_option_without_a_range():
    suite = type("TestMutant", (ModelFamilySuite,), {"family": LeavesAnOptionUnranged()})()
    with pytest.raises(AssertionError, match=r"\['task.sample.steps'\]"):
        suite.test_task_options_declare_their_ranges()
