"""The layout planner with vision-language models: the vision part's arithmetic and ``loongforge plan`` on a VLM.

Numbers are written out by hand from the tiny flavors (see loongforge_vlm/model/planner_parts.py for the counts
per patch): Qwen2-VL-tiny's ViT is d32, ffn 128, 2 blocks, 4 px patches (patch_dim 3*2*4*4 = 96), a 2x2 merger
(merged width 128) to the 48-wide decoder; vlm-tiny is SigLIP-tiny (d32, ffn 64, 2 blocks, patch_dim 48,
8x8 = 64 positions) with a 2x2-merging MLP projector to llama-debug's width 64.
"""

from __future__ import annotations

import re

import pytest
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.models.flavor import flavor_num_params
from loongforge.planner.auto import workload_for
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import Workload, estimate_memory
from loongforge.resolve import resolve_model_flavor
from loongforge_vlm.model.flavors import FLAVORS, num_params
from loongforge_vlm.model.planner_parts import VisionPart


def _seq(length: int) -> LoongForgeConfig:
    config = LoongForgeConfig()
    config.data.seq_length = length
    return config


def test_vision_tokens_default_to_half_the_sequence_and_are_checked():
    """``model.overrides.vision_tokens_per_sample`` sizes the part; unset, half of each sample is image; none at 0."""
    flavor = FLAVORS["qwen2-vl-tiny"]
    assert flavor.planner_parts(_seq(128))[0].vision_tokens == 64
    assert flavor.with_overrides(vision_tokens_per_sample=0).planner_parts(_seq(128)) == ()
    with pytest.raises(ConfigError, match=r"^<defaults>: model.overrides.vision_tokens_per_sample must be between 0 "
                                          r"and data.seq_length \(128\), got 129$"):
        flavor.with_overrides(vision_tokens_per_sample=129).planner_parts(_seq(128))


def test_qwen2_vl_tiny_vision_part_by_hand():
    part = FLAVORS["qwen2-vl-tiny"].with_overrides(vision_tokens_per_sample=16).planner_parts(_seq(128))[0]
    assert part.name == "vision" and part.patches == 16 * 4
    block = (32 + 32) * 2 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)  # LayerNorms
    merger = 64 + (128 * 128 + 128) + (128 * 48 + 48)
    assert part.params == 32 * 96 + 2 * block + merger == 51248
    assert part.param_count(Candidate(tp=2, pp=1, dp=1)) == 51248  # replicated: tp does not divide it
    # Per patch: 2 blocks x (norms 4d + attention 6d + QuickGELU 3f) + patch input 96 + merger 4d.
    per_patch = 2 * (10 * 32 + 3 * 128) + 96 + 4 * 32
    assert part.sample_activation_elements() == per_patch * 64 == 104448
    cand = Candidate(tp=1, pp=1, dp=1, micro_batch_size=2)
    assert part.activation_bytes(cand, 256, Workload(FLAVORS["qwen2-vl-tiny"].foundation, 128, "fp32")) == \
        104448 * 2 * 4
    # Forward: 2 x matmul weights per patch (patch embedding, 2 blocks), attention 4 x 64 x d per block over the
    # image's 64 patches, the merger's matmuls per merged token; training = 3 x forward.
    blocks = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32
    forward = 64 * (2 * (96 * 32 + 2 * blocks) + 2 * 4 * 64 * 32) + 16 * 2 * (128 * 128 + 128 * 48)
    assert part.forward_flops_per_sample() == forward == 5308416
    assert part.flops_per_sample(None) == 3 * forward


def test_encoder_recompute_keeps_only_block_inputs():
    """The re-run block appears in the encoder's backward, after the decoder's activations are freed: not added."""
    flavor = FLAVORS["qwen2-vl-tiny"].with_overrides(encoder_recompute=True)
    part = flavor.with_overrides(vision_tokens_per_sample=16).planner_parts(_seq(128))[0]
    assert part.sample_activation_elements() == (2 * 32 + 96 + 4 * 32) * 64 == 18432
    assert part.flops_per_sample(None) == 4 * part.forward_flops_per_sample()


def test_siglip_vlm_tiny_vision_part_by_hand():
    part = VisionPart(FLAVORS["vlm-tiny"], 16)
    block = (32 + 32) * 2 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 64 + 64) + (64 * 32 + 32)
    siglip = (48 * 32 + 32) + 64 * 32 + 2 * block + 64
    projector = (128 * 64 + 64) + (64 * 64 + 64)
    assert part.params == siglip + projector == 33184
    # Per patch: 2 x (10d + GELU 2f) + patch input 48 + final norm and merged copy 2d + fc1/GELU outputs 2 x 64/4.
    assert part.sample_activation_elements() == (2 * (10 * 32 + 2 * 64) + 48 + 2 * 32 + 2 * 64 / 4) * 64 == 66560
    assert part.attention_spans() == [64, 64]  # one 32 px image = 64 patches per sample


def test_qwen2_5_vl_windows_and_real_encoder_size():
    tiny = VisionPart(FLAVORS["qwen2.5-vl-tiny"], 16)
    assert tiny.attention_spans() == [16, 64, 16, 64]  # 16 px windows of 4 px patches; blocks 1 and 3 full
    real = FLAVORS["qwen2.5-vl-7b"]
    part = VisionPart(real, 1024)
    assert part.params == num_params(real) - flavor_num_params(real.foundation) == 676_550_144
    assert part.attention_spans().count(4096) == 4 and set(part.attention_spans()) == {64, 4096}


def test_vision_term_on_the_first_stage():
    """The whole part sits on stage 0 of a pp=2 layout: replicated weights + fp32 grads + Adam state sharded
    over dp + activations x the 2 micro-batches in flight."""
    flavor = FLAVORS["qwen2-vl-tiny"]
    part = VisionPart(flavor, 16)
    workload = Workload(flavor.foundation, 128, "fp32", kernels="local", components=(part,))
    cand = Candidate(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=4)
    terms = estimate_memory(workload, cand)
    assert terms.stage == 0
    assert terms.terms["vision"] == pytest.approx(51248 * (4 + 4) + 51248 / 2 * 8 + 104448 * 2 * 4 * 2)


def _vlm_config(tmp_path, model: str, seq: int, vision: int):
    path = tmp_path / "vlm.yaml"
    path.write_text(f"model: {{name: {model}, overrides: {{vision_tokens_per_sample: {vision}}}}}\n"
                    f"data: {{seq_length: {seq}}}\ntraining: {{precision: bf16, global_batch_size: 256}}\n")
    return path


def test_plan_command_on_qwen2_5_vl_7b(tmp_path, capsys):
    """1024 image + 1024 text tokens per sample on 8 x 80 GiB: a valid layout, the vision part in the breakdown.
    Published Qwen2.5-VL recipes train the 7B with the ViT replicated and tp 1-2 plus data parallelism."""
    path = _vlm_config(tmp_path, "qwen2.5-vl-7b", 2048, 1024)
    assert main(["plan", str(path), "--devices", "8", "--device-memory", "80GiB", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "+ vision on the first stage: qwen2.5-vl ViT, 0.677B params replicated over tp" in out
    assert "4096 patches per sample" in out
    chosen = re.search(r"chose (tp(\d+) pp(\d+)(?: vpp\d+)?(?: cp(\d+)(?::\w+)?)? dp(\d+) .*?): predicted peak", out)
    assert chosen, out
    tp, pp, cp, dp = (int(g or 1) for g in chosen.group(2, 3, 4, 5))
    assert tp * pp * cp * dp == 8 and tp <= 2
    assert re.search(r"vision \d+(\.\d+)?\s", out)  # the encoder's share of the peak (the unit may wrap)
    config = load_config(str(path), [])
    workload = workload_for(config, resolve_model_flavor(config), "te")
    assert workload.flavor == FLAVORS["qwen2.5-vl-7b"].foundation and workload.components[0].patches == 4096


def test_impossible_vlm_request_names_the_smallest_device_count(tmp_path, capsys):
    path = _vlm_config(tmp_path, "qwen2.5-vl-7b", 2048, 1024)
    assert main(["plan", str(path), "--devices", "1", "--device-memory", "80GiB"]) == 2
    found = re.search(r"smallest device count that works at 80 GiB: (\d+)", capsys.readouterr().err)
    assert found
    assert main(["plan", str(path), "--devices", found.group(1), "--device-memory", "80GiB"]) == 0


def test_parallel_auto_plans_a_vlm_with_its_vision_part(tmp_path):
    """What ``loongforge train`` does first for ``parallel: auto`` (train/run.py): the decision includes the
    vision term, sized from ``model.overrides.vision_tokens_per_sample``."""
    from types import SimpleNamespace

    from loongforge.devices.selection import select_backend
    from loongforge.plugins import get_host
    from loongforge.train.run import _resolve_auto_layout

    path = tmp_path / "auto.yaml"
    path.write_text("model: {name: vlm-tiny, overrides: {vision_tokens_per_sample: 16}}\n"
                    "data: {dataset: vlm-shapes, tokenizer: byte-vision, seq_length: 128}\n"
                    "training: {global_batch_size: 8}\nparallel: {auto: true, planner: {device_memory: 2GiB}}\n")
    config = load_config(str(path), [])
    host = get_host()
    backend, _ = select_backend("cpu", host.registry("device"))
    resolved, decision = _resolve_auto_layout(config, host, backend, SimpleNamespace(rank=1, world_size=1))
    assert not resolved.parallel.auto and decision["layout"].startswith("tp1 pp1 dp1")
    mbs = decision["micro_batch_size"]
    part = VisionPart(FLAVORS["vlm-tiny"], 16)
    expected = part.params * (4 + 4 + 8) + part.sample_activation_elements() * mbs * 4  # fp32, one rank
    assert decision["predicted_memory_terms"]["vision"] == int(expected)
