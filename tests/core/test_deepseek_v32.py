"""DeepSeek-V3.2 (DeepSeek sparse attention on DeepSeek-V3's layers) against transformers' ``DeepseekV32ForCausalLM``
built tiny from a hand-written config, with sequences longer than the indexer's top-k so that sparse attention bites.

* logits (weights perturbed from init, the expert bias too) within 1e-4 of transformers', and the gradients of every
  parameter transformers trains (its indexer gets none: top-k selection has no gradient); a negative control shows
  that the same weights with a top-k covering the whole sequence compute other logits;
* ``convert`` both ways bit for bit (also through pp=2 and ep=2: sparse attention runs at tp=1), the published
  DeepSeek-V3.2 config read as the registered flavor;
* greedy ``generate`` equal to transformers' for 32 tokens (DSA recomputes the context each token: the indexer scores
  whole sequences);
* the indexer's two training phases through ``loongforge train``: the dense warm-up trains the indexers alone (every
  other weight bit for bit unchanged), the sparse phase trains everything and the loss falls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_logits, make_hf_model, word_tokenizer
from loongforge import hookimpl
from loongforge.cli import main
from loongforge.models.deepseek.flavors import FLAVORS
from loongforge.models.deepseek.hf import DeepSeekHFReader
from safetensors.torch import load_file

V32 = "DeepseekV32ForCausalLM"
VOCAB, SEQ = 389, 24
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, index_n_heads=4, index_head_dim=16, index_topk=6,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
)
TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    model = make_hf_model("DeepseekV32Config", V32, TINY)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
    return model


def read(model):
    return DeepSeekHFReader(V32).read_config(json.loads(model.config.to_json_string()), Path("/x/config.json"))


def tokens(batch: int = 2, length: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def ours(flavor, state, batch, *, train: bool = False):
    from loongforge.interop.sharding import load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    with standalone_world() as backend:
        model = build_standalone(flavor, backend)
        load_full_state([model], flavor.hf_adapter().from_hf(state))
        positions = torch.arange(batch.shape[1]).expand(batch.shape[0], -1)
        if not train:
            with torch.no_grad():
                return model.eval()(batch, positions, None)[..., :VOCAB], None
        loss = model.train()(batch[:, :-1], positions[:, :-1], None, labels=batch[:, 1:]).float().mean()
        loss.backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
        grads.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if n.endswith("expert_bias")})
        from loongforge.models.deepseek.hf_layout import megatron_to_hf

        return loss, megatron_to_hf(grads, flavor, per_expert=False)  # experts stacked, as the module holds them


def test_logits_match_transformers_with_sparse_attention_active(reference):
    flavor, batch = read(reference), tokens()
    assert flavor.is_dsa and SEQ > flavor.index_topk
    with torch.no_grad():
        expected = reference(batch).logits
    logits, _ = ours(flavor, reference.state_dict(), batch)
    assert (logits - expected).abs().max().item() <= TOL
    dense, _ = ours(flavor.with_overrides(index_topk=SEQ), reference.state_dict(), batch)
    assert (dense - expected).abs().max().item() > 100 * TOL  # the selection matters: it is not dense attention


def test_gradients_match_transformers(reference):
    flavor, batch = read(reference), tokens(length=SEQ + 1)
    loss, grads = ours(flavor, reference.state_dict(), batch, train=True)
    logits = reference.train()(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5
    trained = {n: p for n, p in reference.named_parameters() if ".indexer." not in n}
    assert all(grads[n].abs().max() == 0 for n in grads if ".indexer." in n)  # no indexer loss without a coefficient
    for name, param in trained.items():
        if param.grad is None:
            continue
        scale = max(param.grad.abs().max().item(), 1e-3)
        assert (grads[name] - param.grad).abs().max().item() <= 1e-4 * scale, name
    assert sum(p.grad is not None for p in trained.values()) > 20
    reference.zero_grad(set_to_none=True)  # the module-wide reference, as the other tests expect it


def test_convert_round_trip_is_bitwise_and_generation_equals_transformers(reference, tmp_path, capsys):
    directory = tmp_path / "hf"
    reference.save_pretrained(directory)
    assert main(["convert", "hf-to-mcore", str(directory), str(tmp_path / "mcore")]) == 0
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    source, back = load_file(directory / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)
    batch = tokens()
    with torch.no_grad():
        assert (checkpoint_logits(tmp_path / "mcore", batch)[..., :VOCAB] - reference(batch).logits).abs().max() <= TOL

    words = word_tokenizer(directory, VOCAB)
    prompt = tokens(1, 9, seed=3)[0].clamp(min=2).tolist()
    capsys.readouterr()
    assert main(["generate", str(directory), "--max-new-tokens", "32", "--ignore-eos", "--jsonl",
                 "--prompt", " ".join(words[i] for i in prompt)]) == 0
    generated = json.loads(capsys.readouterr().out)["tokens"]
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    assert generated == theirs and len(set(theirs)) >= 4


def test_published_config_reads_as_the_registered_flavor(tmp_path):
    published = dict(
        architectures=[V32], model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, index_n_heads=64, index_head_dim=128,
        index_topk=2048, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                       "type": "yarn"}, torch_dtype="bfloat16")
    flavor = DeepSeekHFReader(V32).read_config(published, tmp_path / "config.json")
    assert flavor == FLAVORS["deepseek-v3.2"]
    written = flavor.hf_adapter().config_json("bf16", published)
    assert DeepSeekHFReader(V32).read_config(written, tmp_path / "config.json") == flavor
    from loongforge.models.deepseek.counts import deepseek_num_params

    # V3's layers (its MTP block aside) plus one lightning indexer per layer: 64 x 128 queries from the 1536-wide
    # latent, 128-wide keys with their LayerNorm, 64 head weights
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert flavor.num_params() == deepseek_num_params(FLAVORS["deepseek-v3"], include_mtp=False) + 61 * indexer


class Weights:
    """Every parameter at the start and at the end of a run (TP=1 names)."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.start = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}
        self.trainable = {n for n, p in trainer.model[0].named_parameters() if p.requires_grad}

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        self.end = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}


@pytest.mark.parametrize("phase", ["dense_warmup", "sparse"])
def test_each_indexer_phase_trains_what_it_should(phase, tmp_path, register_plugin):
    from loongforge import load_config
    from loongforge.train.run import run_training

    weights = register_plugin(Weights(), "weights")
    out = tmp_path / "run"
    run_training(load_config(None, [
        f"run.output_dir={out}", "model.name=deepseek-v32-tiny", f"model.overrides.dsa_phase={phase}",
        "data.seq_length=48", "training.micro_batch_size=2", "training.steps=6", "optimizer.lr=0.003",
        "scheduler.warmup_steps=1", "training.threads=1", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.save_at_end=false"]))
    moved = {n for n in weights.start if not torch.equal(weights.start[n], weights.end[n])}
    indexers = {n for n in weights.start if ".core_attention.indexer." in n}
    assert indexers and moved
    if phase == "dense_warmup":
        assert weights.trainable == indexers and moved == indexers  # the rest of the model stays as it was
    else:
        assert weights.trainable == set(weights.start) and indexers < moved
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["loss"] < rows[0]["loss"] - 0.3


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2", "ep2"])
def test_hf_weights_through_a_layout_come_back_bitwise(tmp_path, layout):
    from hf_layout_roundtrip import LAYOUTS, round_trip

    reference = make_hf_model("DeepseekV32Config", V32, {**TINY, "num_hidden_layers": 4})  # two per stage at pp=2
    adapter = read(reference).hf_adapter()
    files = adapter.to_hf(adapter.from_hf(reference.state_dict()))  # the per-expert layout checkpoints store
    back = round_trip(tmp_path, json.loads(reference.config.to_json_string()), files, *LAYOUTS[layout])
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)


def test_packed_rows_are_refused_in_one_line_by_check_and_train(tmp_path, capsys):
    """DSA attends over each query's causal prefix only, so data.pack's block-diagonal masks are refused before
    anything is built; unpacked rows of the same recipe pass the check."""
    from loongforge.cli import main

    recipe = [str(Path(__file__).resolve().parents[2] / "configs" / "sft-tiny.yaml"), "model.name=deepseek-v32-tiny",
              f"run.output_dir={tmp_path / 'run'}"]
    for command, layout in (("check", []), ("check", ["parallel=auto"]), ("train", [])):
        assert main([command, *recipe, "data.pack=true", *layout]) != 0
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "data.pack needs block-diagonal attention masks, which DeepSeek sparse attention" \
            in said[0], said
    assert main(["check", *recipe, "data.pack=false"]) == 0
