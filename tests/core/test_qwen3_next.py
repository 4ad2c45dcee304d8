"""Qwen3-Next (Gated DeltaNet + gated attention + MoE with a gated shared expert) against transformers'
``Qwen3NextForCausalLM``, built tiny from configs written here by hand: logits within 1e-4 in fp32 with both layer
kinds and sequences longer than the DeltaNet chunk, ``convert`` both ways bit for bit, the Qwen3.5 text models,
generation with the recurrent cache, packed documents, a training run whose loss falls, the conformance suite, and
tensor parallelism reproducing the single-process run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import checkpoint_logits, word_tokenizer
from loongforge.cli import main
from loongforge.errors import ConfigError, InteropError
from loongforge.models.hf_format import model_differences
from loongforge.models.qwen3_next.flavors import FLAVORS
from loongforge.models.qwen3_next.hf import Qwen3NextHFReader
from loongforge.testing.family_suite import ModelFamilySuite
from safetensors.torch import load_file

VOCAB = 384
#: A tiny Qwen3-Next: layer 1 full attention, the others Gated DeltaNet (2 key / 4 value heads, value head 12 != key
#: head 8), MoE with a shared expert everywhere but layer 0 (mlp_only_layers), partial rotary 0.25 of head 16.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
TOKENS = 96  # longer than the 64-token DeltaNet chunk, not a multiple of it
TOL = 1e-4


def make_model(config_cls: str, model_cls: str, settings: dict, seed: int = 0):
    """A random fp32 transformers model, weights spread so that any mis-mapped tensor moves the logits far beyond
    the tolerance: zero-centred norms around 0 (applied as 1 + w), the gated DeltaNet norm around 1, decays
    ``A = exp(A_log)`` in [0.1, 1]."""
    import transformers

    config = getattr(transformers, config_cls)(**settings, use_cache=False, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.1, 1.0).log())
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)
            else:
                param.normal_(0.0, 0.1)
    return model


def tokens(batch: int = 2, length: int = TOKENS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def ours_from_hf(flavor, state: dict, batch: torch.Tensor) -> torch.Tensor:
    """Logits of our model built from ``flavor`` with transformers' ``state`` read through the adapter."""
    from loongforge.interop.sharding import load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    with standalone_world() as backend:
        model = build_standalone(flavor, backend)
        load_full_state([model], flavor.hf_adapter().from_hf(state))
        with torch.no_grad():
            positions = torch.arange(batch.shape[1]).expand(batch.shape[0], -1)
            return model.eval()(batch, positions, None)[..., :VOCAB]


def read(architecture: str, model) -> object:
    raw = {**model.config.to_dict(), "architectures": [architecture]}
    return Qwen3NextHFReader(architecture).read_config(raw, Path("config.json"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = make_model("Qwen3NextConfig", "Qwen3NextForCausalLM", TINY)
    directory = tmp_path_factory.mktemp("qwen3-next") / "hf"
    model.save_pretrained(directory)
    return directory, model


# -- flavors and config.json ----------------------------------------------------------------------------------


def test_80b_flavor_is_the_published_config():
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its published values, transformers 4.57 spelling) reads as
    the registered flavor exactly, with 80B parameters of which ~3B are active per token."""
    published = dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", attention_bias=False, decoder_sparse_step=1,
        full_attention_interval=4, head_dim=256, hidden_act="silu", hidden_size=2048, intermediate_size=5120,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_value_head_dim=128, max_position_embeddings=262144, mlp_only_layers=[], moe_intermediate_size=512,
        norm_topk_prob=True, num_attention_heads=16, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
        num_key_value_heads=2, partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=10000000,
        router_aux_loss_coef=0.001, shared_expert_intermediate_size=512, tie_word_embeddings=False,
        torch_dtype="bfloat16", vocab_size=151936)
    flavor = Qwen3NextHFReader("Qwen3NextForCausalLM").read_config(published, Path("config.json"))
    registered = FLAVORS["qwen3-next-80b-a3b"]
    assert model_differences(flavor, registered) == []
    kinds = registered.layer_kinds
    assert kinds.count("linear_attention") == 36 and kinds[3::4] == ("full_attention",) * 12
    assert registered.num_params() / 1e9 == pytest.approx(79.7, abs=0.1)  # "80B total"
    assert registered.num_params(include_embeddings=False, active=True) / 1e9 == pytest.approx(3.25, abs=0.05)
    written = registered.hf_adapter().config_json("bf16", published)
    assert Qwen3NextHFReader("Qwen3NextForCausalLM").read_config(written, Path("c")) == registered
    assert written["rope_theta"] == 10000000 and written["torch_dtype"] == "bfloat16"


def test_parameter_counts_and_planner_terms_are_the_models(hf_dir):
    """The planner's slots state the model transformers builds: ``num_params`` is its parameter count exactly (the
    tied variant and a dense one too), ``decoder_terms`` sums to the same decoder, and layouts that split a DeltaNet
    key head are refused by name."""
    from loongforge.parallel.megatron import Layout

    _, reference = hf_dir
    flavor = read("Qwen3NextForCausalLM", reference)
    assert flavor.num_params() == sum(p.numel() for p in reference.parameters())
    dense = make_model("Qwen3NextConfig", "Qwen3NextForCausalLM", {**TINY, "mlp_only_layers": [0, 1, 2, 3],
                                                                  "tie_word_embeddings": True})
    assert read("Qwen3NextForCausalLM", dense).num_params() == sum(p.numel() for p in dense.parameters())
    terms = flavor.decoder_terms()
    dense_params, expert_params = terms.layer_params()
    embeddings = VOCAB * TINY["hidden_size"] * 2 + TINY["hidden_size"]  # embedding, LM head, final norm
    assert (dense_params + expert_params) * TINY["num_hidden_layers"] == pytest.approx(
        flavor.num_params() - embeddings, rel=1e-12)
    assert flavor.flops_per_token(128) > 0
    assert flavor.check_layout(Layout(tp=2, pp=1, dp=1, sequence_parallel=True, distributed_optimizer=False)) == []
    problems = flavor.with_overrides(linear_num_key_heads=1, linear_num_value_heads=4).check_layout(
        Layout(tp=2, pp=1, dp=1, sequence_parallel=True, distributed_optimizer=False))
    assert [p.reason for p in problems] == ["tp does not divide DeltaNet key heads"]


def test_what_the_family_cannot_express_is_refused():
    reader = Qwen3NextHFReader("Qwen3NextForCausalLM")
    with pytest.raises(InteropError, match="hidden_act='gelu' is not supported"):
        reader.read_config({**TINY, "hidden_act": "gelu"}, Path("c"))
    with pytest.raises(InteropError, match="layer_types must name 4 layers"):
        reader.read_config({**TINY, "layer_types": ["full_attention"] * 3}, Path("c"))
    tiny = FLAVORS["qwen3-next-tiny"]
    with pytest.raises(ConfigError, match="attention_output_gate=False has no place"):
        tiny.with_overrides(attention_output_gate=False).hf_adapter().config_json("fp32")
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads"):
        tiny.with_overrides(linear_num_value_heads=3)
    from loongforge.models.decoder_model import ParallelSettings, transformer_config

    with pytest.raises(ConfigError, match="Gated DeltaNet linear attention is not supported with context"):
        transformer_config(tiny, parallel=ParallelSettings(cp=2))


# -- logits and conversion -------------------------------------------------------------------------------------


def test_convert_gives_transformers_logits_and_converts_back_bit_for_bit(hf_dir, tmp_path, capsys):
    directory, reference = hf_dir
    out, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(directory), str(out)]) == 0
    assert "as model 'qwen3-next-tiny with overrides" in capsys.readouterr().out
    batch = tokens()
    with torch.no_grad():
        expected = reference(batch).logits
    ours = checkpoint_logits(out, batch)[..., :VOCAB]
    assert (ours - expected).abs().max().item() <= TOL

    assert main(["convert", "mcore-to-hf", str(out), str(back)]) == 0
    source, exported = load_file(directory / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["layer_types"] == TINY["layer_types"]
    again = Qwen3NextHFReader("Qwen3NextForCausalLM").read_config(config, back / "config.json")
    assert again == read("Qwen3NextForCausalLM", reference)


def test_fused_in_memory_experts_read_like_the_files(hf_dir):
    directory, reference = hf_dir
    adapter = read("Qwen3NextForCausalLM", reference).hf_adapter()
    from_memory, from_files = adapter.from_hf(reference.state_dict()), adapter.from_hf(load_file(directory /
                                                                                                  "model.safetensors"))
    assert from_memory.keys() == from_files.keys()
    assert all(torch.equal(from_memory[k], from_files[k]) for k in from_files)


def test_greedy_generation_equals_transformers(hf_dir, tmp_path, capsys):
    """``loongforge generate`` on the directory (DeltaNet's recurrent state and the attention layers' KV cache,
    two prompts of different lengths batched) writes transformers' greedy tokens, 32 of them."""
    import shutil

    directory, reference = hf_dir
    local = tmp_path / "hf"
    shutil.copytree(directory, local)
    words = word_tokenizer(local, VOCAB)
    prompts = [tokens(1, 9, seed=5)[0].tolist(), tokens(1, 4, seed=6)[0].tolist()]
    argv = ["generate", str(local), "--max-new-tokens", "32", "--ignore-eos", "--jsonl"]
    for ids in prompts:
        argv += ["--prompt", " ".join(words[max(i, 2)] for i in ids)]
    prompts = [[max(i, 2) for i in ids] for ids in prompts]  # ids 0 and 1 are the word tokenizer's eos and unk
    capsys.readouterr()
    assert main(argv) == 0
    ours = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=32, do_sample=False, use_cache=True, pad_token_id=0)[0, len(ids):]
                  .tolist() for ids in prompts]
    assert all(len(set(t)) >= 4 for t in theirs) and ours == theirs


@pytest.mark.parametrize(("config_cls", "model_cls", "settings"), [
    ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**TINY, "num_experts": 0, "layer_types": None,
                                                 "full_attention_interval": 2, "linear_num_value_heads": 2}),
    ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {k: v for k, v in TINY.items() if k not in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")}),
    ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {k: v for k, v in TINY.items() if k not in (
        "intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")}),
], ids=["qwen3-next-dense", "qwen3.5", "qwen3.5-moe"])
def test_other_layouts_give_transformers_logits(config_cls, model_cls, settings):
    """A dense Qwen3-Next (no value-head grouping, every other layer full) and the Qwen3.5 text models (DeltaNet
    inputs as four flat projections; M-RoPE sections that text positions make plain RoPE)."""
    if config_cls.startswith("Qwen3_5"):
        settings = {**settings, "rope_parameters": {**settings["rope_parameters"], "mrope_section": [1, 1, 0],
                                                    "mrope_interleaved": True}}
    reference = make_model(config_cls, model_cls, settings)
    flavor = read(model_cls, reference)
    batch = tokens(length=80)
    with torch.no_grad():
        expected = reference(batch).logits
    assert (ours_from_hf(flavor, reference.state_dict(), batch) - expected).abs().max().item() <= TOL
    exported = flavor.hf_adapter().to_hf(flavor.hf_adapter().from_hf(reference.state_dict()))
    assert {k for k in exported if "linear_attn" in k} == {k for k in reference.state_dict() if "linear_attn" in k}


# -- generation and packed documents -------------------------------------------------------------------------


class TestGenerationAndPacking:
    """On one tiny model in a world of this class's own (the training test below starts its own world)."""

    @pytest.fixture(scope="class")
    def tiny_model(self):
        from loongforge.interop.world import standalone_world
        from loongforge.models.chunks import build_standalone

        with standalone_world() as backend:
            model = build_standalone(FLAVORS["qwen3-next-tiny"], backend, seed=3)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            yield model.eval()

    def test_cached_generation_equals_recomputation(self, tiny_model):
        """The recurrent cache (convolution tail + state per layer) continues exactly where the prompt left off: logits
        of each cached step equal a full recomputation; batched left-padded prompts generate what each does alone."""
        from loongforge.models.generate import generate_batch
        from megatron.core.inference.contexts import StaticInferenceContext

        context, ids = StaticInferenceContext(1, 128), tokens(1, 70)

        def cached(start: int, end: int) -> torch.Tensor:
            logits = tiny_model(ids[:, start:end], torch.arange(start, end)[None], None, inference_context=context,
                                runtime_gather_output=True)
            context.increment_sequence_len_offset(end - start)
            return logits[:, -1]

        with torch.no_grad():
            full = tiny_model(ids, torch.arange(70)[None], None)
            steps = [cached(0, 67), cached(67, 68), cached(68, 69)]  # the prompt, then one token at a time
        assert (torch.stack(steps, 1) - full[:, 66:69]).abs().max() <= 1e-5

        prompts, options = [[5, 9, 2, 77, 31, 8, 100, 3], [4, 200, 17]], dict(vocab_size=VOCAB, max_positions=4096)
        cached = generate_batch(tiny_model, prompts, 8, use_cache=True, **options)
        alone = [generate_batch(tiny_model, [p], 8, use_cache=False, **options)[0] for p in prompts]
        assert cached == alone and len(set(map(tuple, cached))) == 2


    def test_packed_documents_do_not_mix(self, tiny_model):
        from loongforge.data.packing import block_causal_mask
        from loongforge.parallel.packed_rows import PackedRows

        first, second = tokens(1, 70, seed=2), tokens(1, 50, seed=3)
        mask = block_causal_mask(torch.from_numpy(np.array([[0] * 70 + [1] * 50])))
        positions = torch.cat([torch.arange(70), torch.arange(50)])[None]
        layout = PackedRows.from_cu_seqlens(torch.tensor([0, 70, 120]), 1, 120)
        with torch.no_grad():
            packed = tiny_model(torch.cat([first, second], 1), positions, mask)
            varlen = tiny_model(torch.cat([first, second], 1), positions, None, packed_seq_params=layout)
            alone = tiny_model(second, torch.arange(50)[None], None)
        assert (packed[:, 70:] - alone).abs().max() <= 1e-5
        assert (varlen - packed).abs().max() <= 1e-5  # the boundaries, not the mask: every layer keeps them


# -- training ---------------------------------------------------------------------------------------------------


def test_loss_falls_in_a_short_training_run(tmp_path):
    config = tmp_path / "qwen3-next.yaml"
    config.write_text("model: {name: qwen3-next-tiny}\n")
    out = tmp_path / "out"
    assert main(["train", str(config), f"run.output_dir={out}", "data.seq_length=96", "training.micro_batch_size=4",
                 "training.steps=12", "training.threads=2", "optimizer.lr=0.003", "scheduler.warmup_steps=2",
                 "checkpoint.save_at_end=false", "logging.progress=false", "logging.tensorboard=false"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses


class TestQwen3NextTinyFamily(ModelFamilySuite):
    family = FLAVORS["qwen3-next-tiny"]
    has_hf_adapter = True
