"""The planner's memory and time arithmetic, pinned against hand-computed values and autograd's saved tensors."""

from __future__ import annotations

import pytest
from loongforge.models.registration import all_flavors
from loongforge.planner.hardware import GIB, ClusterSpec, format_bytes, parse_bytes
from loongforge.planner.layouts import Candidate, RecomputePlan
from loongforge.planner.memory import (
    Coefficients,
    Workload,
    estimate_memory,
    layer_activation_elements,
    padded_vocab,
    stage_params,
)
from loongforge.planner.timing import TimeCoefficients, estimate_time, flops_per_token

FLAVORS = all_flavors()
L70 = FLAVORS["llama3-70b"]


def test_llama3_70b_flavor_is_the_published_model():
    from loongforge.models.flavor import flavor_num_params

    assert (L70.num_layers, L70.hidden_size, L70.ffn_hidden_size) == (80, 8192, 28672)
    assert (L70.num_attention_heads, L70.num_query_groups, L70.vocab_size) == (64, 8, 128256)
    assert flavor_num_params(L70) == 70_553_706_496  # the Hugging Face checkpoint's count


def test_sizes_parse_and_print():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("96 GB") == 96 * 10**9
    assert parse_bytes(1234) == 1234
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"
    with pytest.raises(Exception, match="cannot read"):
        parse_bytes("lots")


def test_llama3_70b_params_per_rank_by_hand():
    cand = Candidate(tp=8, pp=1, dp=8)
    # per layer: qkv 8192*(8192+2*1024) + proj 8192*8192 = 150,994,944 over tp 8, norms 2*8192 replicated,
    # SwiGLU 3*8192*28672/8 = 88,080,384  ->  106,971,136 per layer, x80 = 8,557,690,880
    # embedding and output layer 128256*8192/8 = 131,334,144 each (128256 is a multiple of lcm(128, 8)); final norm
    dense, expert = stage_params(L70, cand, 0)
    assert expert == 0
    assert dense == 8_557_690_880 + 2 * 131_334_144 + 8192
    # pp=4: stage 0 has 20 layers + embedding, the last 20 layers + final norm + output layer, the middle only layers
    cand = Candidate(tp=8, pp=4, dp=2)
    assert stage_params(L70, cand, 0)[0] == 20 * 106_971_136 + 131_334_144
    assert stage_params(L70, cand, 1)[0] == 20 * 106_971_136
    assert stage_params(L70, cand, 3)[0] == 20 * 106_971_136 + 131_334_144 + 8192


def test_llama3_70b_memory_terms_by_hand():
    """bf16 weights (2 B), fp32 grads (4 B), Adam m, v + fp32 master (12 B) over dp*cp; TE activations."""
    cand = Candidate(tp=8, pp=1, dp=8, sequence_parallel=True, distributed_optimizer=True, micro_batch_size=1,
                     num_microbatches=16)
    params = 8_557_690_880 + 2 * 131_334_144 + 8192
    terms = estimate_memory(Workload(L70, 8192, "bf16", kernels="te"), cand).terms
    assert terms["weights"] == 2 * params
    assert terms["grads"] == 4 * params
    assert terms["optimizer"] == pytest.approx(12 * params / 8)
    # per token and layer (tp 8, sp): norms 2*(2*8192+1)/8 = 4096.25; attention (q+2kv) + q + kv + q + heads
    # = 10240+8192+1024+8192+64 = 27712 / 8 = 3464; SwiGLU 3*28672/8 = 10752  ->  18312.25 elements
    per_layer = 18312.25 * 8192 * 2
    # last stage also: final norm (2*8192*... unfused count 3h+1 over tp), logits 128256/8 in bf16 + fp32 copy,
    # mask and int64 labels (9 B), and the embedding's int64 token ids (8 B)
    ends = 8192 * ((3 * 8192 + 1) / 8 * 2 + 16032 * (2 + 4) + 9) + 8192 * 8
    assert terms["activations"] == pytest.approx(80 * per_layer + ends)


def test_full_recompute_keeps_layer_inputs_and_pipeline_holds_pp_microbatches():
    w = Workload(L70, 8192, "bf16", kernels="te")
    base = Candidate(tp=8, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=32)
    full = Candidate(**{**base.__dict__, "recompute": RecomputePlan("full", num_layers=20)})
    kept = estimate_memory(w, full)
    # stage 0 is the worst: 4 micro-batches in flight x 20 layers x the layer input (s*h/tp bf16) + token ids
    assert kept.stage == 0
    assert kept.terms["activations"] == pytest.approx(4 * (20 * 8192 * 8192 / 8 * 2 + 8192 * 8))
    # with no recompute the stages differ by in-flight micro-batches: 4, 3, 2, 1 (+ the output layer's logits)
    per_stage = estimate_memory(w, base).per_stage
    assert per_stage[0] > per_stage[1] > per_stage[2]


def test_distributed_optimizer_shards_moe_experts_over_expert_data_parallel():
    q = FLAVORS["qwen3-30b-a3b"]
    cand = Candidate(tp=1, pp=1, dp=16, ep=8, etp=1, distributed_optimizer=True)
    dense, expert = stage_params(q, cand, 0)
    assert expert == 48 * (128 / 8) * 3 * 2048 * 768  # 16 experts of 3 x 2048 x 768 per layer
    terms = estimate_memory(Workload(q, 4096, "bf16"), cand).terms
    # dense params over dp*cp = 16 ranks, experts over the expert-data-parallel ranks 16 / 8 = 2
    assert terms["optimizer"] == pytest.approx(12 * (dense / 16 + expert / 2))


@pytest.mark.parametrize(("name", "modules", "expected"), [
    # live bytes per layer of the CPU build (see test_local_counts_match_live_bytes_after_forward)
    # norms 2 x (2 x 256 + 1); attention (256 + 2 x 128) + 256 + 128 + 256 + 4 heads; fused SwiGLU 3 x 688
    # (fc1 output and fc2 input)
    ("llama-tiny", (), 1026 + 1156 + 2064), ("llama-tiny", ("mlp",), 1026 + 1156),
    ("llama-tiny", ("core_attn",), 1026 + 1152 + 2064),
    # qk-norm adds the contiguous q its norm keeps and the q/k statistics: 512 + 8 + 4
    ("qwen3-tiny", (), 1026 + (1024 + 512 + 256 + 512 + 8) + 524 + 3 * 768),
])
def test_local_activation_counts(name, modules, expected):
    cand = Candidate(tp=1, pp=1, dp=1)
    assert sum(layer_activation_elements(FLAVORS[name], cand, modules, "local").values()) == expected


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_local_counts_match_live_bytes_after_forward(megatron_cpu_world, name):
    """The ``local`` per-layer count equals the live bytes one more layer of the CPU build holds after forward."""
    import gc

    import torch
    from loongforge.models.decoder_model import build_model
    from loongforge.train.measure import profiled_live_bytes
    from torch.profiler import ProfilerActivity, profile

    def live_after_forward(layers: int) -> int:
        model = build_model(FLAVORS[name].with_overrides(num_layers=layers), backend=megatron_cpu_world)
        tokens = torch.randint(0, 300, (2, 64))
        positions = torch.arange(64).expand(2, -1)
        with torch.no_grad():  # the per-pass RoPE tables of this model exist before profiling, as in every step
            model(tokens, positions, None, labels=tokens)
        gc.collect()  # frees of earlier tensors during profiling would count as negative
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(tokens, positions, None, labels=tokens)
        live = profiled_live_bytes(prof)
        del loss, model
        return live

    per_layer = live_after_forward(3) - live_after_forward(2)
    elements = sum(layer_activation_elements(FLAVORS[name], Candidate(1, 1, 1), (), "local").values())
    assert per_layer == pytest.approx(elements * 128 * 4, rel=0.005)  # RoPE tables are shared, not per layer


def test_vocab_padding():
    assert padded_vocab(384, 1) == 384 and padded_vocab(151936, 3) == 152064
    assert padded_vocab(151936, 8) == 151936


def test_time_model_flops_and_terms():
    w = Workload(L70, 8192, "bf16")
    base, extra = flops_per_token(w)
    # 6 x matmul parameters (qkv, proj, SwiGLU; output layer), plus causal attention 6*s*q per layer
    dense = 80 * (8192 * (8192 + 2048) + 8192 * 8192 + 3 * 8192 * 28672) + 128256 * 8192
    assert base == pytest.approx(6 * dense + 80 * 6 * 8192 * 8192)
    assert extra == 0
    cluster = ClusterSpec(num_devices=64, device_memory=80 * GIB)
    cand = Candidate(tp=8, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1, num_microbatches=32)
    plain = estimate_time(w, cand, cluster, TimeCoefficients(narrow_width=0.0)).terms
    slowest = plain["compute"] + plain["stage_imbalance"]
    assert plain["bubble"] == pytest.approx(slowest * 3 / 32)
    full = Candidate(**{**cand.__dict__, "recompute": RecomputePlan("full", num_layers=20)})
    recomputed = estimate_time(w, full, cluster, TimeCoefficients(narrow_width=0.0)).terms
    assert recomputed["compute"] > plain["compute"] * 1.3  # a full extra forward: ~4/3
    assert recomputed["tp_comm"] == pytest.approx(plain["tp_comm"] * 1.5)


def test_coefficients_scale_activations():
    w = Workload(FLAVORS["llama-tiny"], 256, "fp32", kernels="local")
    cand = Candidate(tp=1, pp=1, dp=1, micro_batch_size=4)
    one = estimate_memory(w, cand).terms["activations"]
    assert estimate_memory(w, cand, Coefficients(activation_scale=2.0)).terms["activations"] == pytest.approx(2 * one)
