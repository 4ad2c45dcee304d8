"""``loongforge convert`` at TP=PP=1: lossless in both directions, and the converted model is transformers' model.

For each family switch (Llama 3.1 RoPE scaling, Qwen2 QKV bias, Qwen3 QK-norm; tied and untied
embeddings; Mixtral and Qwen3-MoE experts) a tiny random transformers model is saved, converted to a
LoongForge checkpoint through the CLI, run by megatron (fp32 logits within 1e-4 of transformers'), and
converted back (every tensor bitwise equal, same names). Bad inputs fail with one line naming the file or
tensor, and write nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import HF_TINY_CASES, checkpoint_logits  # noqa: E402
from loongforge.cli import main  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

TOKENS = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))


def _all_tensors(directory):
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("case", sorted(HF_TINY_CASES))
def test_convert_is_lossless_and_matches_transformers(hf_tiny, tmp_path, capsys, case):
    from loongforge.models.hf_format import read_hf_model

    hf_dir, hf = hf_tiny(case)
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    assert f"wrote {tmp_path / 'mcore'}" in capsys.readouterr().out

    with torch.no_grad():
        expected = hf(TOKENS).logits
    actual = checkpoint_logits(tmp_path / "mcore", TOKENS)
    diff = (actual[..., : expected.shape[-1]] - expected).abs().max().item()  # the real vocabulary rows
    print(f"\n{case}: max |logits - transformers| = {diff:.2e} (logit std {expected.std():.2f})")
    assert expected.std() > 0.5 and diff <= 1e-4

    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    original, back = _all_tensors(hf_dir), _all_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], original[name]) for name in original)
    assert read_hf_model(tmp_path / "back").family == read_hf_model(hf_dir).family
    source, written = (json.loads((d / "config.json").read_text()) for d in (hf_dir, tmp_path / "back"))
    assert {k: written[k] for k in source if k != "transformers_version"} == {
        k: v for k, v in source.items() if k != "transformers_version"
    }


def test_sharded_output_loads_in_transformers_and_bin_input_converts(hf_tiny, tmp_path):
    hf_dir, hf = hf_tiny("qwen2-bias-tied")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(dict(load_file(hf_dir / "model.safetensors")), bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    assert main(["convert", "hf-to-mcore", str(bin_dir), str(tmp_path / "mcore")]) == 0
    out = str(tmp_path / "out")
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), out, "--max-shard-size", "40KB"]) == 0

    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = _all_tensors(tmp_path / "out")
    for shard in shards:  # each shard stays under the limit unless it holds one bigger tensor alone
        names = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(names) == 1 or sum(tensors[n].numel() * 4 for n in names) <= 40_000
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, hf(TOKENS).logits)


def _rewrite_tensors(hf_dir, change):
    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(hf_dir, **values):
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(values)
    (hf_dir / "config.json").write_text(json.dumps(config))


BAD_INPUTS = {
    # No converter claims these two (loongforge convert dispatches by config.json's architecture): the one line
    # lists what each converter accepts, core's with the architectures it reads.
    "missing-config": (lambda d: (d / "config.json").unlink(), "no registered handler claims"),
    "unsupported-architecture": (lambda d: _edit_config(d, architectures=["NoSuchForCausalLM"]),
                                 "hf-model (loongforge-core): a Hugging Face directory whose config.json "
                                 "architecture an installed family reads (loongforge list hf_architectures)"),
    "config-of-another-family": (lambda d: _edit_config(d, architectures=["MixtralForCausalLM"]),
                                 "tensor model.layers.0.block_sparse_moe.experts.0.w1.weight is missing"),
    "router-noise": (lambda d: _edit_config(d, architectures=["MixtralForCausalLM"], router_jitter_noise=0.1),
                     "router_jitter_noise=0.1 is not supported for mixtral"),
    "shape-mismatch": (lambda d: _edit_config(d, intermediate_size=100),
                       "model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], "
                       "config.json implies [100, 64]"),
    "missing-tensor": (lambda d: _rewrite_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")),
                       "tensor model.layers.1.self_attn.k_norm.weight is missing"),
    "extra-tensor": (lambda d: _rewrite_tensors(d, lambda t: t.update({"model.layers.0.mlp.x.weight": torch.ones(3)})),
                     "unexpected tensor model.layers.0.mlp.x.weight"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_hf_input_is_one_line_and_writes_nothing(hf_tiny, tmp_path, capsys, bad):
    hf_dir, _ = hf_tiny("qwen3-qknorm-tied")
    damage, message = BAD_INPUTS[bad]
    damage(hf_dir)
    capsys.readouterr()
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_mcore_to_hf_refuses_missing_checkpoint_and_existing_output(hf_tiny, tmp_path, capsys):
    assert main(["convert", "mcore-to-hf", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "hf-exportable-checkpoint (loongforge-core): a LoongForge checkpoint" in capsys.readouterr().err
    hf_dir, _ = hf_tiny("qwen3-qknorm-tied")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "taken")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_model_name_must_match(hf_tiny, tmp_path, capsys):
    hf_dir, _ = hf_tiny("qwen3-qknorm-tied")
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "out"), "--model", "qwen3-tiny"]) == 2
    err = capsys.readouterr().err
    assert "does not match model 'qwen3-tiny': num_layers 2 != 4; hidden_size 64 != 256" in err


def test_generate_prints_transformers_greedy_continuation(hf_tiny, tmp_path, capsys):
    from loongforge.data.tokenizers import ByteTokenizer

    hf_dir, hf = hf_tiny("llama3-rope-untied")
    tok = ByteTokenizer()
    ids = tok.encode("Elizabeth")
    new = []
    with torch.no_grad():
        for _ in range(12):  # greedy over the tokenizer's ids, stopping at eos, as `generate` does
            token = int(hf(torch.tensor([ids + new])).logits[0, -1, : tok.vocab_size].argmax())
            if token == tok.eos_id:
                break
            new.append(token)
    expected = "Elizabeth" + tok.decode(new)

    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    capsys.readouterr()
    for source in (tmp_path / "mcore", hf_dir):
        assert main(["generate", str(source), "--prompt", "Elizabeth", "--tokens", "12", "--tokenizer", "byte"]) == 0
        assert capsys.readouterr().out == expected + "\n"


def test_tokenizer_files_travel_both_ways_and_generate_uses_them(hf_tiny, tmp_path, capsys):
    import tokenizers
    hf_dir, _ = hf_tiny("qwen3-qknorm-tied")
    words = ["<eos>", "<unk>", "the", "cat", "sat"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))

    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (hf_dir / name).read_bytes()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "mcore"), "--prompt", "the cat", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out.strip()) > len("the cat")  # decoded by the carried tokenizer
