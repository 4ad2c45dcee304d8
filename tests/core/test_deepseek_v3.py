"""The DeepSeek-V2/V3 family (MLA, DeepSeekMoE, aux-loss-free expert bias, multi-token prediction) built through
core's family seams, against transformers' own models built tiny from hand-written configs.

What is checked, and against what:

* logits (fp32, weights perturbed from init, the expert bias too) and every parameter's gradient equal
  transformers' ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` -- first dense layer, shared experts,
  group-limited sigmoid routing with the bias, routed scaling, YaRN, the query LoRA, both RoPE layouts; the V2
  router (softmax, greedy and group-limited); negative controls show the bias, the group limit and the RoPE
  layout each move the logits far beyond the tolerance;
* the multi-token-prediction block's logits and its weighted loss equal transformers' ``MtpModel`` on the same
  weights, and without labels (logits, generation) the model answers as its decoder alone; greedy ``generate``
  equals transformers' for 32 tokens;
* ``loongforge convert hf-to-mcore`` / ``mcore-to-hf``: logits of the converted checkpoint, and the files back bit
  for bit (MTP tensors and DeepSeek's per-block embedding/head copies included);
* the reader maps the published ``config.json`` of DeepSeek-V3, Kimi-K2, Moonlight and DeepSeek-V2-Lite onto the
  registered flavors exactly and refuses what megatron would compute differently;
* a short ``loongforge train`` run: the loss falls and every MoE layer's expert bias moves each step by exactly
  ``rate * sign(mean load - load)`` of that step's token counts;
* the planner slots (parameter counts against the published sizes, layout checks) and the family suite.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import checkpoint_logits, make_hf_model, word_tokenizer
from loongforge import hookimpl
from loongforge.errors import ConfigError, InteropError
from loongforge.models.deepseek.flavor import DeepSeekFlavor
from loongforge.models.deepseek.flavors import FLAVORS
from loongforge.models.deepseek.hf import DeepSeekHFReader
from loongforge.testing.family_suite import ModelFamilySuite

V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
#: Tiny DeepSeek-V3: a dense first layer, one shared expert, 8 experts in 4 groups (top-4 in the best 2 groups),
#: routed scaling 2.5, YaRN, the query LoRA; a vocabulary that megatron pads (389 -> 512).
V3_TINY = dict(
    vocab_size=389, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=YARN, num_mtp_layers=0,
)
CASES = {
    "v3": ("DeepseekV3Config", V3, V3_TINY),
    # Moonlight-like: no query LoRA, one expert group, two shared experts, plain RoPE stored as halves.
    "v3-halves-no-qlora": ("DeepseekV3Config", V3, {
        **V3_TINY, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2, "rope_interleave": False,
        "first_k_dense_replace": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    # DeepSeek-V2-Lite-like: softmax scores, no renormalisation, YaRN with mscale 0.707.
    "v2-greedy": ("DeepseekV2Config", V2, {
        **V3_TINY, "q_lora_rank": None, "topk_method": "greedy", "n_group": None, "topk_group": None,
        "norm_topk_prob": False, "routed_scaling_factor": 1.5, "n_shared_experts": 2,
        "rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    "v2-group-limited": ("DeepseekV2Config", V2, {
        **V3_TINY, "topk_method": "group_limited_greedy", "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0}),
}
TOL = 1e-4


def _hf_settings(case: str) -> tuple[str, str, dict]:
    config_cls, arch, settings = CASES[case]
    settings = dict(settings)
    if arch == V2:
        settings.pop("num_mtp_layers")
        settings.pop("rope_interleave", None)
    return config_cls, arch, settings


def _perturb_buffers(model: torch.nn.Module, seed: int = 5) -> None:
    """The expert bias is a buffer make_hf_model leaves at zero: spread it as wide as the sigmoid scores, so that it
    changes which experts are chosen."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)


def hf_model(case: str, **overrides):
    config_cls, arch, settings = _hf_settings(case)
    model = make_hf_model(config_cls, arch, {**settings, **overrides})
    _perturb_buffers(model)
    return model


def read_flavor(model, path: Path = Path("/nonexistent/config.json")) -> DeepSeekFlavor:
    raw = json.loads(model.config.to_json_string())
    return DeepSeekHFReader(type(model).__name__).read_config(raw, path)


def load_exact(model, full: dict) -> None:
    """``full`` into ``model`` (TP=PP=EP=1 names are the module's own): every tensor, nothing else."""
    result = model.load_state_dict(full, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing[:3], result.unexpected_keys[:3])


def megatron_model(flavor, backend, hf_state: dict):
    from loongforge.models.chunks import build_standalone

    model = build_standalone(flavor, backend)
    load_exact(model, flavor.hf_adapter().from_hf(hf_state))
    return model


def tokens_and_positions(vocab: int, batch: int = 2, seq: int = 24, seed: int = 3):
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(seq).unsqueeze(0).expand(batch, -1)


@pytest.fixture
def world():
    from loongforge.interop.world import standalone_world

    with standalone_world() as backend:
        yield backend


# -- core's expert names where layers differ ---------------------------------------------------------------------


def test_core_names_experts_by_their_expert_axis():
    """A model with dense first layers shards as non-homogeneous (``moe_layer_freq`` a list): an expert's sharded
    tensor has one prepended axis (the expert), not two (layer, expert); core must read the expert index there, or
    every expert of a DeepSeek layer would load expert 0's weights."""
    from loongforge.interop import sharding

    mixed = SimpleNamespace(prepend_axis_num=1, global_offset=(3, 0, 0))
    name = sharding._full_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", {"1": 1}, mixed)
    assert name == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    stacked = SimpleNamespace(prepend_axis_num=2, global_offset=(1, 5, 0, 0))
    name = sharding._full_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", {"0": 2}, stacked)
    assert name == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"


# -- logits and gradients against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(world, case):
    reference = hf_model(case)
    flavor = read_flavor(reference)
    assert flavor.hf_architecture == CASES[case][1]
    model = megatron_model(flavor, world, reference.state_dict())
    tokens, positions = tokens_and_positions(flavor.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
        ours = model.eval()(tokens, positions, None)
    assert ours.shape == (2, 24, 512)
    assert (ours[..., flavor.vocab_size:] == torch.finfo(ours.dtype).min).all()  # padded rows masked
    diff = (ours[..., : flavor.vocab_size] - expected).abs().max().item()
    assert diff <= TOL, f"{case}: max abs logit difference {diff:.3g} (logits up to {expected.abs().max():.2f})"


def test_bias_group_limit_and_rope_layout_each_change_the_logits(world):
    """Negative controls: each feature the parity test covers moves the logits by far more than its tolerance, so a
    mapping that dropped one would fail it."""
    reference = hf_model("v3")
    flavor = read_flavor(reference)
    tokens, positions = tokens_and_positions(flavor.vocab_size)
    state = reference.state_dict()

    def logits(flavor_, state_):
        with torch.no_grad():
            return megatron_model(flavor_, world, state_).eval()(tokens, positions, None)[..., : flavor.vocab_size]

    base = logits(flavor, state)
    unbiased = {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in state.items()}
    ungrouped = flavor.with_overrides(moe_router_num_groups=None, moe_router_group_topk=None)
    halves = flavor.with_overrides(rope_interleave=False)  # the same tensors read as the other RoPE layout
    for name, other in (("bias", logits(flavor, unbiased)), ("groups", logits(ungrouped, state)),
                        ("rope layout", logits(halves, state))):
        assert (other - base).abs().max().item() > 100 * TOL, name


def test_gradients_match_transformers(world):
    """Cross-entropy over the batch and the gradient of every parameter (experts, router, MLA, embeddings) equal
    transformers' within 1e-4 of each tensor's largest gradient."""
    from loongforge.models.deepseek.hf_layout import megatron_to_hf

    reference = hf_model("v3")
    flavor = read_flavor(reference)
    model = megatron_model(flavor, world, reference.state_dict())
    tokens, positions = tokens_and_positions(flavor.vocab_size, seq=25)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = model.train()(inputs, positions[:, :-1], None, labels=labels).float().mean()
    logits = reference.train()(inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, flavor.vocab_size), labels.reshape(-1))
    assert abs(loss.item() - expected.item()) <= 1e-5
    loss.backward()
    expected.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if n.endswith("expert_bias")})
    ours = megatron_to_hf(grads, flavor, per_expert=False)
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    assert set(theirs) <= set(ours)
    for name, grad in theirs.items():
        scale = max(grad.abs().max().item(), 1e-3)
        assert (ours[name] - grad).abs().max().item() <= 1e-4 * scale, name


# -- multi-token prediction ----------------------------------------------------------------------------------------


def hf_with_mtp():
    """transformers' tiny DeepSeek-V3 and its ``MtpModel`` (one block), weights perturbed; and the two together in
    DeepSeek's checkpoint layout (block 0 as ``model.layers.<num_layers>.``)."""
    from transformers.modeling_layers import MtpModel

    reference = hf_model("v3", num_mtp_layers=1)
    mtp = MtpModel(reference, 1).float().eval()
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in mtp.layers.named_parameters():
            fresh = torch.rand(param.shape, generator=gen) + 0.5 if "norm" in name else \
                torch.randn(param.shape, generator=gen) * 0.15
            param.copy_(fresh)
    _perturb_buffers(mtp.layers, seed=6)
    layer = f"model.layers.{V3_TINY['num_hidden_layers']}."
    state = dict(reference.state_dict())
    for name, tensor in mtp.layers.state_dict().items():
        rest = name.split(".", 1)[1]  # drop the block index 0
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        state[layer + rest] = tensor
    return reference, mtp, state


def test_mtp_block_matches_transformers_mtp_model(world):
    """The MTP block's logits (position i: the decoder's output at i and the embedding of token i + 1) and its loss
    (predicting token i + 2, weighted by mtp_loss_scaling_factor) equal transformers' MtpModel on the same weights;
    the gradient that loss sends to the block's projection too."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    reference, mtp, state = hf_with_mtp()
    flavor = read_flavor(reference).with_overrides(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    model = megatron_model(flavor, world, state)
    vocab, seq = flavor.vocab_size, 24
    tokens, positions = tokens_and_positions(vocab, seq=seq + 1)
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], positions[:, :-1]

    captured = []
    model.mtp.layers[0].register_forward_hook(lambda module, args, output: captured.append(output[0]))
    with torch.no_grad():
        model.eval()(inputs, positions, None, labels=labels)
        ours = model.output_layer(captured[-1])[0].transpose(0, 1)[:, : seq - 1, :vocab]
        hidden = reference.model(inputs).last_hidden_state
        block = mtp.forward_layer(0, hidden[:, :-1], positions[:, :-1], None, input_ids=inputs[:, 1:])
        expected = mtp._project_to_logits(block)
    assert (ours - expected).abs().max().item() <= TOL

    MTPLossLoggingHelper.tracker.pop("values", None)
    model.train()(inputs, positions, None, labels=labels).float().mean().backward()
    hidden = reference.model(inputs).last_hidden_state.detach()
    mtp.train()
    block = mtp.forward_layer(0, hidden[:, :-1], positions[:, :-1], None, input_ids=inputs[:, 1:])
    mtp_loss = torch.nn.functional.cross_entropy(mtp._project_to_logits(block).reshape(-1, vocab),
                                                 labels[:, 1:].reshape(-1))
    (flavor.mtp_loss_scaling_factor * mtp_loss).backward()
    logged = MTPLossLoggingHelper.tracker["values"][0].item()  # what a run would log as the MTP loss
    assert abs(logged - mtp_loss.item()) <= 1e-5
    ours_grad = model.mtp.layers[0].eh_proj.weight.grad
    theirs_grad = mtp.layers[0].eh_proj.weight.grad
    assert (ours_grad - theirs_grad).abs().max().item() <= 1e-4 * theirs_grad.abs().max().item()


def test_mtp_round_trips_in_deepseeks_layout():
    """MTP tensors go to ``model.layers.<L + k>.`` (enorm, hnorm, eh_proj, shared_head.norm, the layer) with copies of
    the embedding and LM head, as DeepSeek-V3's files hold them; reading ignores the copies; bit for bit back."""
    reference, _, state = hf_with_mtp()
    flavor = read_flavor(reference).with_overrides(mtp_num_layers=1)
    adapter = flavor.hf_adapter()
    layer = f"model.layers.{V3_TINY['num_hidden_layers']}."
    full = adapter.from_hf(state)
    assert full["mtp.layers.0.final_layernorm.weight"] is state[layer + "shared_head.norm.weight"]
    files = adapter.to_hf(full)
    assert torch.equal(files[layer + "embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(files[layer + "shared_head.head.weight"], state["lm_head.weight"])
    bias = layer + "mlp.gate.e_score_correction_bias"
    assert torch.equal(files[bias], state[bias])
    shapes = adapter.tensor_shapes(list(files))
    assert set(shapes) == set(files) and shapes[layer + "embed_tokens.weight"] is None
    assert all(tuple(files[n].shape) == s for n, s in shapes.items() if s is not None)
    again = adapter.to_hf(adapter.from_hf(files))
    assert files.keys() == again.keys() and all(torch.equal(files[k], again[k]) for k in files)


def test_without_labels_the_model_answers_as_its_decoder_alone(world):
    """The MTP block only adds a training loss: logits (generation, evaluation by logits) skip it and equal those of
    the same weights built without the block, bit for bit."""
    reference, _, state = hf_with_mtp()
    flavor = read_flavor(reference)
    tokens, positions = tokens_and_positions(flavor.vocab_size)
    with torch.no_grad():
        with_block = megatron_model(flavor.with_overrides(mtp_num_layers=1), world, state).eval()
        without = megatron_model(flavor.with_overrides(mtp_num_layers=0), world, reference.state_dict()).eval()
        assert with_block.mtp_process and not without.mtp_process
        assert torch.equal(with_block(tokens, positions, None), without(tokens, positions, None))


# -- generation -------------------------------------------------------------------------------------------------


def test_greedy_generation_equals_transformers(tmp_path, capsys):
    """``loongforge generate`` on a DeepSeek-V3 directory (with its MTP block, which generation leaves out) writes
    transformers' greedy tokens, 32 of them, for two prompts of different lengths batched together (left padding,
    megatron's KV cache of MLA's per-head keys and values)."""
    from loongforge.cli import main
    from safetensors.torch import save_file

    reference, _, state = hf_with_mtp()
    reference.save_pretrained(tmp_path)  # config.json (num_nextn_predict_layers 1); the weights with the block:
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors", {"format": "pt"})
    from loongforge.models.hf_format import read_hf_model

    assert read_hf_model(tmp_path).family.mtp_num_layers == 1
    vocab = V3_TINY["vocab_size"]
    words = word_tokenizer(tmp_path, vocab)
    draw = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, vocab, (length,), generator=draw).tolist() for length in (9, 4)]
    argv = ["generate", str(tmp_path), "--max-new-tokens", "32", "--ignore-eos", "--jsonl"]
    for ids in prompts:
        argv += ["--prompt", " ".join(words[i] for i in ids)]
    assert main(argv) == 0
    ours = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                  for ids in prompts]
    assert all(len(set(t)) >= 4 for t in theirs)  # varied text, not one repeated token
    assert ours == theirs


# -- conversion through the CLI ----------------------------------------------------------------------------------


def test_convert_round_trip_is_bitwise(tmp_path, capsys):
    from loongforge.cli import main
    from safetensors.torch import load_file

    reference = hf_model("v3")
    source = tmp_path / "hf"
    reference.save_pretrained(source)
    assert main(["convert", "hf-to-mcore", str(source), str(tmp_path / "mcore")]) == 0
    assert "as model 'deepseek-v3" in capsys.readouterr().out
    tokens, _ = tokens_and_positions(389)
    with torch.no_grad():
        expected = reference(tokens).logits
    assert (checkpoint_logits(tmp_path / "mcore", tokens)[..., :389] - expected).abs().max().item() <= TOL
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [V3] and config["num_nextn_predict_layers"] == 0
    assert DeepSeekHFReader(V3).read_config(config, tmp_path / "back" / "config.json") == read_flavor(reference)


def test_transformers_files_without_mtp_weights_read_as_no_mtp(tmp_path):
    """transformers writes ``num_nextn_predict_layers: 1`` but drops the MTP weights: the flavor follows the files."""
    reference = hf_model("v3", num_mtp_layers=1)
    reference.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    assert DeepSeekHFReader(V3).read_config(raw, tmp_path / "config.json").mtp_num_layers == 0


# -- the reader on the published configs, and what it refuses -------------------------------------------------------

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu",
            tie_word_embeddings=False, attention_bias=False, moe_layer_freq=1)
PUBLISHED = {
    "deepseek-v3": dict(
        architectures=[V3], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, ep_size=1, routed_scaling_factor=2.5,
        q_lora_rank=1536, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True,
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"}, torch_dtype="bfloat16", **_MLA),
    "kimi-k2": dict(
        architectures=[V3], model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=0, num_attention_heads=64,
        num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384, routed_scaling_factor=2.827,
        q_lora_rank=1536, topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=8,
        first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=50000.0,
        rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"}, torch_dtype="bfloat16", **_MLA),
    "moonlight-16b-a3b": dict(
        architectures=[V3], model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=2.446, q_lora_rank=None, topk_method="noaux_tc",
        num_nextn_predict_layers=0,
        n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=True,
        scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=None, torch_dtype="bfloat16", **_MLA),
    "deepseek-v2-lite": dict(
        architectures=[V2], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, q_lora_rank=None, topk_method="greedy",
        n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False,
        scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096, "type": "yarn"}, torch_dtype="bfloat16", **_MLA),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_the_registered_flavors(name, tmp_path):
    """No weights beside the config: the MTP depth is the config's (DeepSeek-V3's files hold its block)."""
    raw = PUBLISHED[name]
    flavor = DeepSeekHFReader(raw["architectures"][0]).read_config(raw, tmp_path / "config.json")
    assert flavor == FLAVORS[name]
    written = flavor.hf_adapter().config_json("bf16", raw)
    assert DeepSeekHFReader(raw["architectures"][0]).read_config(written, tmp_path / "config.json") == flavor
    assert written["model_type"] == raw["model_type"] and written["aux_loss_alpha"] == 0.001  # base keys kept


@pytest.mark.parametrize(("arch", "change", "message"), [
    (V3, {"num_experts_per_tok": 6}, "ranks groups by their 2 best scores"),
    (V3, {"norm_topk_prob": False}, "renormalises the chosen sigmoid scores"),
    (V3, {"scoring_func": "softmax"}, "routes by sigmoid scores"),
    (V3, {"topk_method": "greedy"}, "noaux_tc"),
    (V3, {"num_key_value_heads": 32}, "one per query head"),
    (V3, {"hidden_act": "gelu"}, "only SiLU"),
    (V3, {"moe_layer_freq": 2}, "every layer after first_k_dense_replace"),
    (V3, {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "attention_factor": 1.2}}, "explicit attention_factor"),
    (V3, {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "mscale_all_dim": 1.0}}, "mscale_all_dim without mscale"),
    (V3, {"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "RoPE type 'dynamic'"),
    (V2, {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}, "needs num_experts_per_tok == topk"),
    (V2, {"norm_topk_prob": True}, "never renormalises"),
])
def test_reader_refuses_what_megatron_would_compute_differently(arch, change, message, tmp_path):
    base = PUBLISHED["deepseek-v3" if arch == V3 else "deepseek-v2-lite"]
    with pytest.raises(InteropError, match=message) as info:
        DeepSeekHFReader(arch).read_config({**base, **change}, tmp_path / "config.json")
    assert str(info.value).startswith(str(tmp_path / "config.json"))


def test_registry_names_the_family_and_its_architectures():
    from loongforge.plugins import get_host

    models, archs = get_host().registry("model"), get_host().registry("hf_architecture")
    assert models.load("deepseek-ai/DeepSeek-V3") is FLAVORS["deepseek-v3"]
    assert models.load("moonshotai/Kimi-K2-Instruct") is FLAVORS["kimi-k2"]
    assert isinstance(archs.load("deepseek_v3"), DeepSeekHFReader) and archs.load("kimi_k2").architecture == V3
    assert archs.load(V2).architecture == V2
    description = models.entry("deepseek-v3").description
    assert "671.03B params (37.55B active)" in description and "3 dense + 256 experts" in description
    assert "4/8 groups" in description and "MTP 1" in description


# -- the flavor and the planner slots -----------------------------------------------------------------------------


def test_parameter_counts_match_the_published_sizes():
    count = {name: flavor.num_params() for name, flavor in FLAVORS.items()}
    from loongforge.models.deepseek.counts import deepseek_num_params

    # DeepSeek-V3's 671B main model (the 671,026,419,200 of its files less the 58 x 256 expert-bias entries)
    assert deepseek_num_params(FLAVORS["deepseek-v3"], include_mtp=False) == 671_026_404_352
    assert FLAVORS["deepseek-v3"].num_params(active=True) / 1e9 == pytest.approx(38.2, abs=0.05)  # 37B + MTP
    assert count["deepseek-v2-lite"] == 15_706_484_224  # the safetensors total of DeepSeek-V2-Lite
    assert count["kimi-k2"] / 1e12 == pytest.approx(1.026, abs=0.001)  # "1T total, 32B activated"
    assert FLAVORS["kimi-k2"].num_params(active=True) / 1e9 == pytest.approx(32.9, abs=0.05)
    assert count["moonlight-16b-a3b"] / 1e9 == pytest.approx(15.96, abs=0.01)


def test_decoder_terms_state_mla_and_the_layer_mix():
    """The planner's terms add up to the counted parameters, and FLOPs follow the active parameters."""
    for flavor in FLAVORS.values():
        terms = flavor.decoder_terms()
        params = terms.num_layers * sum(part.count for part in terms.params)
        expected = flavor.num_params(include_embeddings=False) - flavor.hidden_size  # the final norm is core's
        assert params == pytest.approx(expected, rel=1e-9)
    v3 = FLAVORS["deepseek-v3"]
    flops = v3.flops_per_token(4096)
    assert 6 * v3.num_params(active=True) < flops < 6 * v3.num_params(active=True) * 1.2  # + causal attention
    tiny = FLAVORS["deepseek-v3-tiny"]
    assert tiny.flops_per_token(64) != tiny.with_overrides(kv_lora_rank=64).flops_per_token(64)


def test_check_layout_names_what_mla_needs():
    from loongforge.parallel.megatron import Layout

    tiny = FLAVORS["deepseek-v3-tiny"]

    def problems(flavor, **sizes):
        layout = Layout(**{"tp": 1, "pp": 1, "dp": 1, "sequence_parallel": False, "distributed_optimizer": False,
                           **sizes})
        return [p.message for p in flavor.check_layout(layout)]

    assert problems(tiny, tp=2, sequence_parallel=True, ep=2, pp=2) == []
    assert any("kv_lora_rank + qk_rope_head_dim (47)" in m for m in problems(
        tiny.with_overrides(kv_lora_rank=31), tp=2, sequence_parallel=True))
    assert any("ep=3 must divide" in m for m in problems(tiny, ep=3))
    assert any("multi-token prediction" in m for m in problems(tiny.with_overrides(mtp_num_layers=1), cp=2))


def test_flavor_derives_mla_fields_and_refuses_what_its_layers_lack():
    tiny = FLAVORS["deepseek-v3-tiny"]
    assert (tiny.head_dim, tiny.num_query_groups, tiny.kv_channels) == (32, 4, 32)
    wider = tiny.with_overrides(v_head_dim=48, num_attention_heads=8)
    assert (wider.head_dim, wider.num_query_groups) == (48, 8)  # derived again, never stale
    assert tiny.moe_layers == (False, True, True, True)
    for change, message in [
        ({"position_embedding": "rope"}, "applies its own RoPE"),
        ({"add_bias_linear": True}, "add_bias_linear=True is not supported"),
        ({"moe_router_group_topk": None}, "set both moe_router_num_groups and moe_router_group_topk"),
        ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "divisible by moe_router_num_groups"),
        ({"moe_score_function": "softmax"}, "moe_expert_bias needs moe_score_function 'sigmoid'"),
        ({"first_k_dense": 4}, "leaves no MoE layer"),
        ({"qk_rope_head_dim": 15}, "must be even"),
    ]:
        with pytest.raises(ConfigError, match=message):
            tiny.with_overrides(**change)


def test_the_family_chooses_its_load_balancing_loss():
    """A family's config fields take precedence over core's: V3's sequence-wise loss where it has a coefficient,
    aux-loss-free (the bias alone) where it has none."""
    from loongforge.models.decoder_model import transformer_config
    from loongforge.models.deepseek.layer_spec import decoder_spec

    def balancing(flavor):
        return transformer_config(flavor, spec=decoder_spec(flavor)).moe_router_load_balancing_type

    tiny = FLAVORS["deepseek-v3-tiny"]
    assert balancing(tiny) == "none"
    assert balancing(tiny.with_overrides(moe_aux_loss_coeff=1e-3)) == "seq_aux_loss"
    assert balancing(tiny.with_overrides(moe_aux_loss_coeff=1e-3, moe_aux_loss_type="aux_loss")) == "aux_loss"
    assert decoder_spec(tiny).config_fields["moe_layer_freq"] == [0, 1, 1, 1]


# -- training: the loss falls, the expert bias follows the loads -------------------------------------------------


class BiasWatch:
    """Each step's expert bias of every router and the tokens each expert received (what megatron updates from)."""

    def __init__(self):
        self.biases: list[dict[int, torch.Tensor]] = []
        self.loads: list[list[list[int]]] = []
        self.routers = []

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in trainer.model for name, m in chunk.named_modules()
                        # the decoder's, counted per layer
                        if isinstance(m, TopKRouter) and "mtp" not in name.split(".")]
        self.biases.append(self._biases())

    def _biases(self):
        return {router.layer_number: router.expert_bias.detach().clone() for router in self.routers}

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        self.biases.append(self._biases())
        self.loads.append(trainer.expert_tokens)


def test_training_moves_the_expert_bias_towards_balance(tmp_path, register_plugin):
    from loongforge import load_config
    from loongforge.train.run import run_training

    watch = register_plugin(BiasWatch(), "bias-watch")
    steps, rate, seq, batch = 6, 1e-3, 32, 4
    config = load_config(None, [
        f"run.output_dir={tmp_path / 'out'}", "model.name=deepseek-v3-tiny", f"data.seq_length={seq}",
        "training.micro_batch_size=2", f"training.global_batch_size={batch}", f"training.steps={steps}",
        "optimizer.lr=0.003", "scheduler.warmup_steps=1", "training.threads=1", "logging.progress=false",
        "logging.tensorboard=false", "checkpoint.save_at_end=false",
    ])
    run_training(config)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    # the MTP block (predicting two tokens ahead) trains beside the decoder and its loss is logged every step
    assert all(row["mtp_loss"] > 0 for row in rows) and rows[-1]["mtp_loss"] < rows[0]["mtp_loss"] - 0.3
    assert sorted(watch.biases[0]) == [2, 3, 4]  # layer 1 is dense: no router
    assert all(torch.equal(b, torch.zeros(8)) for b in watch.biases[0].values())
    for step in range(steps):
        for layer, before in watch.biases[step].items():
            load = torch.tensor(watch.loads[step][layer - 1], dtype=torch.float32)
            assert load.sum() == batch * seq * 4  # every token to its top-4
            expected = before + torch.sign(load.mean() - load) * rate
            assert torch.equal(watch.biases[step + 1][layer], expected), (step, layer)
    final = torch.stack(list(watch.biases[-1].values()))
    assert final.abs().max().item() > 0 and len(set(final.flatten().tolist())) > 2


# -- the family suite -------------------------------------------------------------------------------------------


class TestDeepSeekV3Tiny(ModelFamilySuite):
    family = FLAVORS["deepseek-v3-tiny"].with_overrides(num_layers=2)
    has_hf_adapter = True
    hf_extra_tensors = ("model.layers.2.*",)  # the MTP block, which transformers' model does not load


def test_flavor_is_plain_data():
    tiny = copy.deepcopy(FLAVORS["deepseek-v3-tiny"])
    assert tiny == FLAVORS["deepseek-v3-tiny"] and hash(tiny) == hash(FLAVORS["deepseek-v3-tiny"])
