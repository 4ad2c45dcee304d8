"""The example third-party model family (examples/loongforge-example-family) works as a research group would ship
it: pip-installed with no change to core, its GPT-2-style decoder is listed, trains 10 steps from the package's
own config, gives the same losses at tp=2 as at tp=1, resumes bit-exactly, passes its own conformance tests, and
``loongforge generate`` and ``loongforge convert mcore-to-hf`` work on its checkpoint (the converted directory
loads in transformers and computes our logits)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import checkpoint_logits
from example_packages import installed_example, loongforge, pip

DIST = "loongforge-example-family"
COMMON = ("logging.tensorboard=false",)


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    with installed_example(DIST, tmp_path_factory.mktemp("family")) as source:
        yield source


@pytest.fixture(scope="module")
def tiny_config(example):
    return example / "src" / "loongforge_example_family" / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def trained(tiny_config, tmp_path_factory):
    """The package's tiny config trained for its 10 steps at tp=1 (checkpoints at steps 5 and 10)."""
    out = tmp_path_factory.mktemp("tp1")
    result = loongforge("train", str(tiny_config), f"run.output_dir={out}", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_listed_as_plugin_and_models(example):
    plugins = loongforge("plugins").stdout
    assert DIST in plugins and "example-family" in plugins
    models = loongforge("list", "models").stdout
    assert "example-gpt-tiny" in models and "example-gpt decoder (GPT-2 style" in models


def test_trains_ten_steps(trained):
    losses = _losses(trained)
    assert len(losses) == 10 and all(loss == loss for loss in losses)
    assert losses[-1] < losses[0] - 0.5  # a byte-level corpus: the first steps learn the byte distribution
    assert [p.name for p in sorted((trained / "checkpoints").glob("step-*"))] == ["step-0000005", "step-0000010"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_equals_tp1(trained, tiny_config, tmp_path):
    result = loongforge("train", "--nproc", "2", str(tiny_config), f"run.output_dir={tmp_path}", "parallel.tp=2",
                        "checkpoint.save_at_end=false", "checkpoint.interval=0", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parallel: tp=2 pp=1 dp=1" in result.stdout
    assert _losses(tmp_path) == pytest.approx(_losses(trained), rel=1e-5)


def test_resumes_bit_exactly(trained, tiny_config, tmp_path):
    result = loongforge("train", str(tiny_config), f"run.output_dir={tmp_path}",
                        f"checkpoint.resume={trained / 'checkpoints' / 'step-0000005'}", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "at step 5" in result.stdout
    assert _losses(tmp_path) == _losses(trained)[5:]


def test_generate_on_its_checkpoint(trained):
    runs = [loongforge("generate", str(trained / "checkpoints"), "--prompt", "It is ", "--tokens", "12")
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:]
    text = runs[0].stdout
    assert text.startswith("It is ") and len(text) > len("It is \n")  # the prompt, then its continuation
    assert runs[0].stdout == runs[1].stdout  # greedy: the same continuation twice


def test_convert_to_hugging_face_loads_in_transformers_with_our_logits(trained, tmp_path, plugin_host):
    import torch
    import transformers

    out = tmp_path / "hf"
    result = loongforge("convert", "mcore-to-hf", str(trained / "checkpoints"), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    ours = checkpoint_logits(trained / "checkpoints", tokens)[..., :expected.shape[-1]]
    assert (ours - expected).abs().max().item() <= 1e-5


def test_its_own_conformance_tests_pass(example):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=example, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_uninstall_removes_it(example):
    pip("uninstall", "--yes", DIST)
    try:
        assert DIST not in loongforge("plugins").stdout
        assert "example-gpt-tiny" not in loongforge("list", "models").stdout
    finally:
        pip("install", "--no-deps", "--no-build-isolation", str(example))  # the fixture removes it
