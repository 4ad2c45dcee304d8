"""The example third-party model family (examples/loongforge-example-family) is OLMo-2 with layer code of its own,
and it crosses Hugging Face through its own reader and adapter, with no table entry in core.

Pip-installed as its users install it, the plugin must: compute transformers' ``Olmo2ForCausalLM`` logits and
gradients (fp32, a tiny model whose ``Olmo2Config`` is written here by hand and whose weights are drawn far from
their init); ``convert hf-to-mcore`` a ``save_pretrained`` directory and ``convert mcore-to-hf`` it back bit for
bit into a directory transformers loads; fine-tune from ``model.load: hf:DIR`` alone, naming its own model; give
the same losses and gradient norms at tp=2 (two gloo processes) as at tp=1, which its whole-width QK-norm has to
reduce over the ranks for; and pass its own conformance tests. Without the plugin, core refuses the directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import checkpoint_logits, make_hf_model
from example_packages import installed_example
from loongforge.cli import main
from safetensors.torch import load_file

# pip-installs into the running environment, which every other test's plugin discovery reads: run apart
# from the parallel suite (nox -s tests runs these after it, in one process)
pytestmark = pytest.mark.venv_install

DIST = "loongforge-example-family"
ARCH = "Olmo2ForCausalLM"
#: A tiny OLMo-2 in transformers' own terms (not derived from the plugin): 4 query heads in 2 groups, so the
#: whole-width norms span heads of different groups and split over two tensor-parallel ranks; a vocabulary that
#: is not a multiple of 128, so megatron's padded rows are exercised.
OLMO2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=389, max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=1,
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
VOCAB = OLMO2["vocab_size"]
TOL = 1e-5


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    with installed_example(DIST, tmp_path_factory.mktemp("family")) as source:
        yield source


@pytest.fixture(scope="module")
def host(example):
    """A plugin host discovered after the install (it holds the example plugin), process-wide for the module."""
    from loongforge.plugins import PluginHost, get_host, reset_host

    previous = get_host()
    reset_host(PluginHost())
    try:
        yield
    finally:
        reset_host(previous)


@pytest.fixture
def host_without_plugin(monkeypatch):
    """A plugin host that leaves the example plugin out, as if it were not installed."""
    from loongforge.plugins import PluginHost, get_host, reset_host

    monkeypatch.setenv("LOONGFORGE_DISABLE_PLUGINS", "example-family")
    previous = get_host()
    reset_host(PluginHost())
    try:
        yield
    finally:
        reset_host(previous)


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory):
    """``(directory, model)``: a tiny perturbed ``Olmo2ForCausalLM`` saved with ``save_pretrained``."""
    model = make_hf_model("Olmo2Config", "Olmo2ForCausalLM", dict(OLMO2))
    directory = tmp_path_factory.mktemp("olmo2") / "hf"
    model.save_pretrained(directory)
    return directory, model


def _tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def _one_line_error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_core_has_no_entry_for_olmo2_and_refuses_it_without_the_plugin(host_without_plugin, olmo2_dir, tmp_path,
                                                                        capsys):
    from loongforge.errors import InteropError
    from loongforge.models.hf_format import read_hf_model
    from loongforge.models.hf_layouts import FAMILIES

    assert ARCH not in {row.architecture for row in FAMILIES.values()} and "olmo2" not in FAMILIES
    err = _one_line_error(capsys, ["convert", "hf-to-mcore", str(olmo2_dir[0]), str(tmp_path / "out")])
    assert "no registered handler claims" in err
    with pytest.raises(InteropError, match=f"architecture '{ARCH}' is not supported"):
        read_hf_model(olmo2_dir[0])


def test_listed_with_its_models_and_its_architecture(host, capsys):
    capsys.readouterr()
    assert main(["plugins"]) == 0 and main(["list", "models"]) == 0 and main(["list", "hf_architectures"]) == 0
    out = capsys.readouterr().out
    assert DIST in out and "olmo2-tiny" in out and "olmo2-1b" in out and "olmo2 decoder (OLMo-2" in out
    assert ARCH in out


def test_logits_and_gradients_equal_transformers(host, olmo2_dir, capsys):
    """Read through core's crossing (the plugin's reader, then its adapter), built by the plugin's layer specs."""
    from loongforge.interop.sharding import load_full_state
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.hf_format import read_hf_model

    directory, reference = olmo2_dir
    family = read_hf_model(directory).family
    assert type(family).__name__ == "Olmo2Flavor"
    assert family.num_params() == sum(p.numel() for p in reference.parameters())  # the QK-norms counted too
    adapter = family.hf_adapter()
    tokens = _tokens()
    reference.zero_grad(set_to_none=True)
    expected = reference(tokens).logits
    torch.nn.functional.cross_entropy(expected[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    with standalone_world() as backend:
        model = build_standalone(family, backend)
        load_full_state([model], adapter.from_hf(load_file(directory / "model.safetensors")))
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        ours = model(tokens, positions, None)[..., :VOCAB]
        torch.nn.functional.cross_entropy(ours[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads = adapter.to_hf({name: p.grad for name, p in model.named_parameters()})
    diff = (ours - expected).abs().max().item()
    hf_grads = dict(reference.named_parameters())
    assert sorted(grads) == sorted(hf_grads)
    grad_diff = max((grads[name] - hf_grads[name].grad).abs().max().item() for name in grads)
    largest = max(p.grad.abs().max().item() for p in hf_grads.values())
    with capsys.disabled():
        print(f"\nolmo2 vs transformers (fp32): max |logits diff| {diff:.2e} (logit std {expected.std():.2f}), "
              f"max |grad diff| {grad_diff:.2e} (largest grad {largest:.2f})")
    assert expected.std() > 0.5 and diff <= TOL
    assert largest > 0.05 and grad_diff <= TOL


def test_convert_both_ways_is_bitwise_and_loads_in_transformers(host, olmo2_dir, tmp_path, capsys):
    import transformers

    directory, reference = olmo2_dir
    out, back = tmp_path / "mcore", tmp_path / "back"
    capsys.readouterr()
    assert main(["convert", "hf-to-mcore", str(directory), str(out)]) == 0
    assert "as model 'olmo2-tiny with overrides {'vocab_size': 389}'" in capsys.readouterr().out
    tokens = _tokens(5)
    with torch.no_grad():
        expected = reference(tokens).logits
    assert (checkpoint_logits(out, tokens)[..., :VOCAB] - expected).abs().max().item() <= TOL

    assert main(["convert", "mcore-to-hf", str(out), str(back)]) == 0
    source, exported = load_file(directory / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == [ARCH] and written["model_type"] == "olmo2"
    loaded = transformers.Olmo2ForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - expected).abs().max().item() <= 1e-6


def _train_config(path, hf_dir, out) -> str:
    config = {
        "run": {"output_dir": str(out), "seed": 7}, "model": {"load": f"hf:{hf_dir}"},
        "data": {"dataset": "shipped-corpus", "tokenizer": "byte", "seq_length": 32},
        "training": {"steps": 4, "micro_batch_size": 2, "precision": "fp32", "threads": 1, "sample_tokens": 0},
        "optimizer": {"lr": 3.0e-3}, "scheduler": {"warmup_steps": 0},
        "checkpoint": {"interval": 0, "save_at_end": True},
        "logging": {"interval": 1, "progress": False, "tensorboard": False},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def _metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


@pytest.fixture(scope="module")
def trained(host, olmo2_dir, tmp_path_factory):
    """``loongforge train`` (tp=1, in this process) of a config whose model is only ``load: hf:DIR``."""
    tmp = tmp_path_factory.mktemp("train")
    config = _train_config(tmp / "run.yaml", olmo2_dir[0], tmp / "tp1")
    assert main(["train", config]) == 0
    return config, tmp / "tp1"


def test_hf_dir_alone_trains_and_names_the_plugin_model(trained):
    _, run = trained
    rows = _metrics(run)
    assert sorted(rows) == [1, 2, 3, 4] and all(row["loss"] == row["loss"] for row in rows.values())
    assert rows[4]["loss"] < rows[1]["loss"]
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    recorded = yaml.safe_load((checkpoint / "config.yaml").read_text())
    assert recorded["model"]["name"] == "olmo2-tiny" and recorded["model"]["overrides"] == {"vocab_size": VOCAB}


@pytest.mark.distributed
def test_tp2_reproduces_tp1(trained, tmp_path, capsys):
    """Two gloo ranks, each with half of every layer's heads: the whole-width QK-norm sums its squares over both."""
    config, tp1 = trained
    cmd = [sys.executable, "-m", "loongforge.cli", "train", config, "--nproc", "2", "parallel.tp=2",
           f"run.output_dir={tmp_path}", "checkpoint.save_at_end=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "tp=2 pp=1 dp=1" in done.stdout
    reference, rows = _metrics(tp1), _metrics(tmp_path)
    assert sorted(rows) == sorted(reference)
    worst = {key: max(abs(rows[s][key] - reference[s][key]) / abs(reference[s][key]) for s in rows)
             for key in ("loss", "grad_norm")}
    with capsys.disabled():
        print(f"\nolmo2 tp=2 vs tp=1 over {len(rows)} steps: max relative difference loss {worst['loss']:.2e}, "
              f"grad_norm {worst['grad_norm']:.2e}")
    for key, diff in worst.items():
        assert diff <= TOL, f"{key}: tp=2 differs from tp=1 by {diff:.2e} (relative)"


def test_its_own_conformance_tests_pass(example):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=example, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
