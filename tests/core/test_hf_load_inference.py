"""``model.load: hf:DIR`` alone names the model and its tokenizer.

A tiny random Qwen3 directory (2 layers, d64, head_dim 32, untied) with a byte-level BPE tokenizer of 300 ids trained
here is fine-tuned for 5 steps by ``loongforge train`` from a config whose ``model:`` is nothing but ``load: hf:DIR``:
the shape comes from DIR's config.json, the tokenizer from DIR's tokenizer.json. The ``checkpoint.save_hf`` export
must load in transformers with logits within 1e-5 of ours, carry DIR's tokenizer files, and generate what
transformers' greedy decoding over that tokenizer writes. A name that disagrees, an override that changes the
shape, an architecture we do not build and a tokenizer larger than the vocabulary each fail in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from conftest import HF_TINY_CASES, checkpoint_logits, make_hf_model, tiny_settings  # noqa: E402
from loongforge import load_config  # noqa: E402
from loongforge.checkpoint.manifest import write_manifest  # noqa: E402
from loongforge.cli import main  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

CORPUS = Path(__file__).parents[2] / "loongforge-core/src/loongforge/data/corpus/persuasion.txt"
EOS = "<|endoftext|>"
PROMPT = "It is a truth"


def write_bpe_tokenizer(directory, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` ids learnt from 50 kB of the shipped corpus, saved as
    ``save_pretrained`` would (tokenizer.json, tokenizer_config.json naming the eos token); no downloads."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")[:50_000]], trainer)
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}), encoding="utf-8")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint (vocab 384) saved with ``save_pretrained``, with a 300-id tokenizer beside it."""
    directory = tmp_path_factory.mktemp("hf") / "qwen3"
    make_hf_model("Qwen3Config", "Qwen3ForCausalLM", tiny_settings("qwen3-qknorm-untied")).save_pretrained(directory)
    write_bpe_tokenizer(directory, 300)
    return directory


def _config(path, hf_dir, out, **sections) -> str:
    """A config whose ``model:`` is only ``load: hf:DIR``, plus tiny training settings and ``sections``; the data is
    a 20 kB text file beside the config."""
    text = path.parent / "corpus.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8")[-20_000:], encoding="utf-8")
    config = {
        "run": {"output_dir": str(out)}, "model": {"load": f"hf:{hf_dir}"},
        "data": {"dataset": "text", "paths": [str(text)], "seq_length": 32},
        "training": {"steps": 5, "micro_batch_size": 2, "threads": 1}, "scheduler": {"warmup_steps": 0},
        "optimizer": {"lr": 1.0e-3}, "checkpoint": {"save_hf": True},
        "logging": {"progress": False, "tensorboard": False},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def _one_line_error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.fixture(scope="module")
def trained(qwen3_dir, tmp_path_factory):
    """The 5-step run of the acceptance test: ``loongforge train`` on the name-less config; its last checkpoint."""
    tmp = tmp_path_factory.mktemp("run")
    assert main(["train", _config(tmp / "run.yaml", qwen3_dir, tmp / "out")]) == 0
    return tmp / "out" / "checkpoints" / "step-0000005"


@pytest.mark.slow
def test_hf_dir_alone_fine_tunes_and_exports_what_transformers_computes(qwen3_dir, trained, capsys):
    recorded = yaml.safe_load((trained / "config.yaml").read_text())
    assert recorded["model"]["name"] == "qwen3-tiny"  # the nearest registered flavor, the rest as overrides
    assert recorded["model"]["overrides"]["num_layers"] == 2 and recorded["model"]["overrides"]["head_dim"] == 32
    assert recorded["data"]["tokenizer"] == f"hf:{qwen3_dir}"  # DIR's tokenizer, as data.tokenizer was unset

    export = trained / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # carried into the export and the checkpoint
        assert (export / name).read_bytes() == (qwen3_dir / name).read_bytes()
        assert (trained / "tokenizer" / name).read_bytes() == (qwen3_dir / name).read_bytes()
    source, tuned = load_file(qwen3_dir / "model.safetensors"), load_file(export / "model.safetensors")
    assert sorted(tuned) == sorted(source)
    assert max((tuned[k] - source[k]).abs().max().item() for k in source) > 1e-4  # 5 steps moved the weights

    tokens = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(tokens).logits
    diff = (checkpoint_logits(trained, tokens)[..., :384] - expected).abs().max().item()
    with capsys.disabled():
        print(f"\nmodel.load hf:DIR alone, 5 steps, save_hf: max |logits - transformers| = {diff:.2e} "
              f"(logit std {expected.std():.2f})")
    assert expected.std() > 0.5 and diff <= 1e-5

    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    ids, eos = tok.encode(PROMPT).ids, tok.token_to_id(EOS)
    new = []
    with torch.no_grad():  # transformers' greedy continuation over the tokenizer's 300 ids, stopping at eos
        for _ in range(8):
            token = int(hf(torch.tensor([ids + new])).logits[0, -1, :300].argmax())
            if token == eos:
                break
            new.append(token)
    capsys.readouterr()
    for source_dir in (export, trained):  # no --tokenizer: each uses the tokenizer it carries
        assert main(["generate", str(source_dir), "--prompt", PROMPT, "--tokens", "8"]) == 0
        assert capsys.readouterr().out == PROMPT + tok.decode(new) + "\n"


def test_check_resolves_the_model_from_config_json(qwen3_dir, tmp_path, capsys):
    capsys.readouterr()
    assert main(["check", _config(tmp_path / "run.yaml", qwen3_dir, tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "model: qwen3-tiny (from loongforge-core)" in lines and "tokenizer: hf (from loongforge-core)" in lines
    assert f"model.load: {qwen3_dir}" in lines and lines[-1].endswith("run.yaml: OK")


@pytest.mark.parametrize("case", sorted(HF_TINY_CASES))
def test_every_architecture_of_the_table_names_its_model_and_the_saved_config_rebuilds_it(tmp_path, case):
    """For each family we convert (dense, MoE, GPT-2, NeoX, Phi, Gemma), the name-less config resolves to exactly
    the flavor config.json describes, and the config it records (as a checkpoint's config.yaml) rebuilds that flavor
    without the directory."""
    from loongforge.config import config_to_dict
    from loongforge.interop.load_source import model_load_source
    from loongforge.models.hf_format import read_hf_model
    from loongforge.resolve import resolve_model_flavor

    config_cls, _, _ = HF_TINY_CASES[case]
    getattr(transformers, config_cls)(**tiny_settings(case)).save_pretrained(tmp_path / "hf")
    config = load_config(None, [f"model.load=hf:{tmp_path / 'hf'}"])
    flavor = resolve_model_flavor(config)
    assert flavor == read_hf_model(tmp_path / "hf").family and config.model.name
    assert model_load_source(config, flavor) == tmp_path / "hf"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
    shutil.rmtree(tmp_path / "hf")
    recorded = load_config(tmp_path / "config.yaml")
    assert resolve_model_flavor(recorded) == flavor and recorded.model.name == config.model.name


def test_a_tokenizer_the_config_names_is_kept(qwen3_dir, tmp_path):
    named = load_config(_config(tmp_path / "a.yaml", qwen3_dir, tmp_path, data={"tokenizer": "byte"}))
    assert named.data.tokenizer == "byte" and named.model.name is None  # named by DIR once resolved
    bare = tmp_path / "bare"
    shutil.copytree(qwen3_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert load_config(_config(tmp_path / "b.yaml", bare, tmp_path)).data.tokenizer == "byte"  # DIR has none


REFUSED = {
    # (config sections, config.json edits, tokenizer size, the one line's telling part)
    "another-name": ({"model": {"name": "qwen3-tiny"}}, {}, None,
                     "config.json does not match model 'qwen3-tiny': num_layers 2 != 4; hidden_size 64 != 256"),
    "shape-override": ({"model": {"overrides": {"num_layers": 3}}}, {}, None,
                       "config.json does not match model 'qwen3-tiny': num_layers 2 != 3"),
    "unknown-architecture": ({}, {"architectures": ["NoSuchForCausalLM"]}, None,
                             "model.load: {dir}/config.json: architecture 'NoSuchForCausalLM' is not supported"),
    "tokenizer-too-large": ({}, {}, 500, "tokenizer 'hf:{dir}' has 500 ids but model 'qwen3-tiny' only 384"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_trained_is_refused_in_one_line(qwen3_dir, tmp_path, capsys, case):
    sections, edits, tokenizer_size, message = REFUSED[case]
    hf_dir = tmp_path / "hf"
    shutil.copytree(qwen3_dir, hf_dir)
    if edits:
        (hf_dir / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()), **edits}))
    if tokenizer_size:
        write_bpe_tokenizer(hf_dir, tokenizer_size)
    err = _one_line_error(capsys, ["check", _config(tmp_path / "run.yaml", hf_dir, tmp_path / "out", **sections)])
    assert message.format(dir=hf_dir) in err, err


@pytest.mark.slow
def test_generate_refuses_a_checkpoint_whose_tokenizer_is_larger_than_its_vocabulary(trained, tmp_path, capsys):
    """A checkpoint assembled from two runs (another run's 500-id tokenizer beside these 384-row weights; its manifest
    rewritten so that it verifies) is refused before anything is decoded."""
    step = tmp_path / "step-0000005"
    shutil.copytree(trained, step)
    write_bpe_tokenizer(step / "tokenizer", 500)
    (step / "manifest.json").unlink()
    write_manifest(step, step=5)
    err = _one_line_error(capsys, ["generate", str(step), "--prompt", PROMPT, "--tokens", "2"])
    assert "has 500 ids but the model in" in err and "only 384" in err
