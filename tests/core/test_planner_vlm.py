"""The planner with a composed model (a decoder plus parts outside it), without any plugin.

Core must stay model-agnostic: it plans the family's declared ``decoder`` and asks the family for its other parts
through ``planner_parts(config)`` (:class:`loongforge.models.family.ModelFamily`). A stand-in family plays the VLM
here; the real vision part is tested in tests/vlm/test_vlm_planner.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.registration import all_flavors
from loongforge.planner.auto import workload_for
from loongforge.planner.hardware import GIB, ClusterSpec
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import Workload, estimate_memory
from loongforge.planner.timing import TimeCoefficients, estimate_time

DECODER = all_flavors()["qwen2.5-7b"]


@dataclass(frozen=True)
class Part:
    """A replicated part: 100M parameters, 1 KiB of activations per vision token, 1 GFLOP per vision token."""

    vision_tokens: int
    name: str = "vision"
    description: str = "a stand-in vision part"

    def param_count(self, candidate):
        return 100_000_000

    def activation_bytes(self, candidate, tokens, workload):
        return candidate.micro_batch_size * self.vision_tokens * 1024

    def flops_per_sample(self, workload):
        return self.vision_tokens * 1e9

    def rank_flops_per_sample(self, workload, candidate):
        return self.flops_per_sample(workload)


@dataclass(frozen=True)
class Composed(ModelFamily):
    foundation: object

    @property
    def decoder(self):
        return self.foundation

    def planner_parts(self, config):
        return (Part(config.data.seq_length // 4),)


def _config() -> LoongForgeConfig:
    config = LoongForgeConfig()
    config.data.seq_length = 2048
    config.training.precision = "bf16"
    return config


def test_workload_plans_the_decoder_and_asks_the_family_for_its_parts():
    workload = workload_for(_config(), Composed(DECODER), "te")
    assert workload.flavor is DECODER
    assert workload.components == (Part(512),)
    assert workload_for(_config(), DECODER, "te").components == ()  # a plain LLM has none


def test_a_task_engine_family_is_refused_in_one_line():
    class TaskModel(ModelFamily):
        engine = "task"

    config = _config()
    config.model.name = "some-dit"
    with pytest.raises(ConfigError, match=r"^<defaults>: model 'some-dit' is trained by the task engine; parallel: "
                                          r"auto chooses megatron layouts only \(`loongforge plan` ranks"):
        workload_for(config, TaskModel(), "te")


def test_part_memory_is_its_own_first_stage_term():
    """Weights (bf16) + fp32 grads + Adam state sharded over dp by the distributed optimizer + activations x the
    micro-batches in flight on stage 0 (1F1B: pp of them); nothing on the last stage."""
    cand = Candidate(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=8)
    workload = Workload(DECODER, 2048, "bf16", components=(Part(512),))
    estimate = estimate_memory(workload, cand)
    plain = estimate_memory(Workload(DECODER, 2048, "bf16"), cand)
    vision = 100_000_000 * (2 + 4) + 100_000_000 / 2 * (8 + 4) + 2 * 512 * 1024 * 2
    assert estimate.per_stage[0] - plain.per_stage[0] == pytest.approx(vision)
    assert estimate.per_stage[1] == pytest.approx(plain.per_stage[1])
    assert estimate.stage == 0 and estimate.terms["vision"] == pytest.approx(vision)
    assert estimate.terms["weights"] == plain.terms["weights"]  # the part's memory is not folded into the decoder's


def test_part_compute_is_not_split_by_tensor_parallelism():
    """A replicated encoder runs whole on every tp rank: its seconds are the same at tp 1 and tp 2."""
    cluster = ClusterSpec(8, 80 * GIB)
    coeffs = TimeCoefficients(narrow_width=0.0)
    with_part = Workload(DECODER, 2048, "bf16", components=(Part(1024),))
    plain = Workload(DECODER, 2048, "bf16")
    added = []
    for tp in (1, 2):
        cand = Candidate(tp=tp, pp=1, dp=8 // tp, micro_batch_size=1, num_microbatches=4)
        delta = estimate_time(with_part, cand, cluster, coeffs).terms["compute"]
        added.append(delta - estimate_time(plain, cand, cluster, coeffs).terms["compute"])
    assert added[0] == pytest.approx(added[1]) == pytest.approx(4 * 1024e9 / cluster.device_flops)
