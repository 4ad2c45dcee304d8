"""What the planner, the FLOP/MFU figures and the layout pre-flight read about a model comes from the model family's
slots (``ModelFamily.decoder_terms``, ``flops_per_token``, ``num_params``, ``check_layout``), not from
``DecoderFlavor`` fields.

The family here is a stand-in for an outside author's Multi-Latent-Attention decoder: a ``DecoderFlavor`` subclass
whose attention is low-rank projections with query/key heads wider than value heads, while its inherited fields
(heads, query groups, ``kv_channels``) are llama-tiny's. Every number below is the family's; code that read the
fields would get llama-tiny's numbers and fail. It also refuses tensor parallelism, which ``loongforge check``,
``train``'s layout check and the planner must all honour with the family's own reason.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from loongforge import hookimpl
from loongforge.config.schema import LoongForgeConfig, ParallelConfig, TrainingConfig
from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import DecoderFlavor, flavor_num_params
from loongforge.models.registration import all_flavors
from loongforge.models.sizing import ActivationPart, FlopPart, LayoutProblem, ParamPart
from loongforge.parallel.megatron import MegatronStrategy
from loongforge.planner.auto import workload_for
from loongforge.planner.hardware import GIB, ClusterSpec
from loongforge.planner.layouts import Candidate, SearchSpace, enumerate_layouts
from loongforge.planner.memory import Workload, estimate_memory, layer_activation_elements, stage_params
from loongforge.planner.planner import plan
from loongforge.planner.timing import TimeCoefficients, estimate_time, flops_per_token
from loongforge.train.throughput import model_flops_per_step

PLAIN = all_flavors()["llama-tiny"]  # 4 layers, d256, 4 heads in 2 query groups, SwiGLU 688, vocab 384
REASON = "latent attention runs at tp=1 only"
SEQ = 256


@dataclass(frozen=True)
class LatentFlavor(DecoderFlavor):
    """Queries through a rank-``q_lora_rank`` bottleneck, keys and values from a rank-``kv_lora_rank`` latent,
    query/key heads ``qk_head_dim`` wide and value heads ``v_head_dim``: wider attention than the fields imply."""

    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_head_dim: int = 96
    v_head_dim: int = 48

    def attention_params(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        return (h * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim + h * self.kv_lora_rank
                + self.kv_lora_rank * n * (self.qk_head_dim + self.v_head_dim) + n * self.v_head_dim * h)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        field_attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * 2 * self.kv_channels
        return (flavor_num_params(self, include_embeddings=include_embeddings)
                + self.num_layers * (self.attention_params() - field_attention))

    def decoder_terms(self, kernels: str = "te"):
        terms = super().decoder_terms(kernels)
        n = self.num_attention_heads
        attention = self.attention_params()
        params = tuple(ParamPart("attention", attention, "tp") if p.name == "attention" else p for p in terms.params)
        activations = tuple(a for a in terms.activations if a.name != "attention") + (
            ActivationPart("attention", self.q_lora_rank + self.kv_lora_rank + n * (3 * self.qk_head_dim
                                                                                     + 2 * self.v_head_dim)),
            ActivationPart("attention", n, recomputed_by=("core_attn",)))
        flops = []
        for part in terms.flops:
            if part.name == "attention_projections":
                part = FlopPart(part.name, 2 * attention, width=n * self.qk_head_dim)
            elif part.name == "core_attention":
                part = dataclasses.replace(part, flops=n * (self.qk_head_dim + self.v_head_dim))
            flops.append(part)
        return dataclasses.replace(terms, params=params, activations=activations, flops=tuple(flops),
                                   context_parallel_width=n * (3 * self.qk_head_dim + self.v_head_dim))

    def check_layout(self, layout):
        problems = super().check_layout(layout)
        if layout.tp > 1:
            problems.insert(0, LayoutProblem(f"tp={layout.tp}: the latent projections are not split by tensor "
                                             "parallelism in this family; use tp=1", REASON))
        return problems


LATENT = LatentFlavor(**{f.name: getattr(PLAIN, f.name) for f in dataclasses.fields(PLAIN)} | {"family": "latent"})


@dataclass(frozen=True)
class Composed(ModelFamily):
    """A model composed around the latent decoder: the defaults of its slots ask the decoder."""

    foundation: DecoderFlavor

    @property
    def decoder(self):
        return self.foundation


def _by_hand_flops_per_token(seq: int) -> float:
    """3 x forward: 2 per weight of the attention projections and the SwiGLU MLP, causal attention's two products
    (``heads x (qk + v)`` per position), the output layer."""
    h, f, n = LATENT.hidden_size, LATENT.ffn_hidden_size, LATENT.num_attention_heads
    layer = 2 * LATENT.attention_params() + 2 * 3 * h * f + n * (LATENT.qk_head_dim + LATENT.v_head_dim) * seq
    return 3 * (LATENT.num_layers * layer + 2 * LATENT.vocab_size * h)


def test_the_family_is_llama_tiny_by_its_fields():
    """What core would read from the fields is llama-tiny's (so every difference below comes from the slots)."""
    fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size")
    assert [getattr(LATENT, n) for n in fields] == [getattr(PLAIN, n) for n in fields]
    assert LATENT.attention_params() != 2 * 256 * 256 + 2 * 256 * 128  # wider attention than the fields imply
    assert LATENT.num_params() - PLAIN.num_params() == 4 * (LATENT.attention_params() - 196_608)


def test_planner_memory_uses_the_family_parameters_and_activations():
    cand = Candidate(tp=1, pp=2, dp=1, micro_batch_size=2, num_microbatches=2)
    extra = LATENT.attention_params() - (256 * (256 + 2 * 128) + 256 * 256)  # per layer
    for stage in (0, 1):
        assert stage_params(LATENT, cand, stage)[0] - stage_params(PLAIN, cand, stage)[0] == 2 * extra
    latent, plain = (estimate_memory(Workload(f, SEQ, "fp32", kernels="local"), cand).terms for f in (LATENT, PLAIN))
    assert latent["weights"] - plain["weights"] == pytest.approx(4 * 2 * extra)  # fp32, two layers a stage
    elements = sum(layer_activation_elements(LATENT, cand, (), "local").values())
    attention = 96 + 64 + 4 * (3 * 96 + 2 * 48) + 4
    assert elements == 2 * (2 * 256 + 1) + attention + 3 * 688  # norms, the family's attention, fused SwiGLU
    assert elements != sum(layer_activation_elements(PLAIN, cand, (), "local").values())


def test_planner_time_and_the_mfu_count_use_the_family_flops():
    by_hand = _by_hand_flops_per_token(SEQ)
    assert LATENT.flops_per_token(SEQ) == by_hand != PLAIN.flops_per_token(SEQ)
    assert flops_per_token(Workload(LATENT, SEQ))[0] == by_hand  # the planner's time model
    cand = Candidate(tp=1, pp=1, dp=2, micro_batch_size=1, num_microbatches=4)
    cluster = ClusterSpec(2, 80 * GIB)
    coeffs = TimeCoefficients(narrow_width=0.0)
    compute = estimate_time(Workload(LATENT, SEQ), cand, cluster, coeffs).terms["compute"]
    assert compute == pytest.approx(by_hand * SEQ * 4 / cluster.device_flops)

    # what train's metrics divide by the step time: the run's own function, through workload_for
    from loongforge.train.run import _model_flops_per_step

    config = LoongForgeConfig()
    config.data.seq_length = SEQ
    for model in (LATENT, Composed(LATENT)):  # a composed model's default asks its decoder
        assert _model_flops_per_step(config, model, SimpleNamespace(device_type="cpu"), 8) == 8 * SEQ * by_hand
        assert model_flops_per_step(workload_for(config, model, "te"), 8) == 8 * SEQ * by_hand


def test_a_family_without_flops_reports_none():
    class Uncounted(ModelFamily):
        @property
        def decoder(self):
            return PLAIN

        def flops_per_token(self, seq_length):
            return None

    config = LoongForgeConfig()
    assert model_flops_per_step(workload_for(config, Uncounted(), "te"), 8) is None


def test_the_planner_never_proposes_a_layout_the_family_refuses():
    rejected: Counter = Counter()
    layouts = list(enumerate_layouts(LATENT, 4, SEQ, 8, SearchSpace(), rejected))
    assert layouts and {c.tp for c in layouts} == {1} and rejected[REASON] == 2  # tp=2 and tp=4
    assert {c.tp for c in enumerate_layouts(PLAIN, 4, SEQ, 8, SearchSpace(), Counter())} == {1, 2}
    result = plan(Workload(LATENT, SEQ, "fp32", kernels="local"), ClusterSpec(4, 8 * GIB),
                  SearchSpace(global_batch_size=8))
    assert result.best.candidate.tp == 1 and result.rejected[REASON] == 2


def test_the_layout_check_fails_on_the_family_reason():
    layout = MegatronStrategy.validate(ParallelConfig(tp=2), 2, "run.yaml")
    MegatronStrategy.check_model(layout, PLAIN, TrainingConfig(micro_batch_size=1), "run.yaml")  # llama-tiny splits
    for model in (LATENT, Composed(LATENT)):
        with pytest.raises(ConfigError, match=r"^run.yaml: tp=2: the latent projections are not split by tensor "
                                              r"parallelism in this family; use tp=1$"):
            MegatronStrategy.check_model(layout, model, TrainingConfig(micro_batch_size=1), "run.yaml")


class LatentPlugin:
    @hookimpl
    def loongforge_register_models(self, registry):
        registry.register("latent-tiny", LATENT, description="a latent-attention stand-in")


def test_check_fails_at_tp2_naming_the_family_reason_and_plan_keeps_tp1(register_plugin, capsys, monkeypatch,
                                                                         tmp_path):
    from pathlib import Path

    from loongforge.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)
    register_plugin(LatentPlugin(), "latent")
    args = ["configs/quickstart.yaml", "model.name=latent-tiny", f"run.output_dir={tmp_path}"]
    assert main(["check", *args]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "configs/quickstart.yaml: OK"
    assert main(["check", *args, "parallel.tp=2", "--nproc", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == ["error: configs/quickstart.yaml: tp=2: the latent projections are not split by "
                                "tensor parallelism in this family; use tp=1"]
    assert main(["plan", *args, "--devices", "2", "--device-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("latent 4 layers, seq 256")
    assert REASON in out and "chose tp1 " in out
