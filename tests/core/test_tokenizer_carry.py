"""Every checkpoint and export carries the tokenizer its weights were trained with, and ``generate`` decodes with it.

A byte-tokenizer run (a tokenizer-less tiny Qwen3 directory through ``model.load: hf:DIR`` alone, 2 steps,
``checkpoint.save_hf``) writes the descriptor ``loongforge_tokenizer.json`` into ``tokenizer/`` of its checkpoint and
beside the export's config.json; both conversions carry it on, and ``generate`` on each decodes the same text with no
``--tokenizer``. A checkpoint that knows no tokenizer (converted from a directory without one: the vocab-300 case that
used to claim ``byte`` and print garbage), or whose carried tokenizer disagrees with its config.yaml, is refused in
one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import make_hf_model, tiny_settings  # noqa: E402
from loongforge.checkpoint.manifest import write_manifest  # noqa: E402
from loongforge.cli import main  # noqa: E402

CORPUS = Path(__file__).parents[2] / "loongforge-core/src/loongforge/data/corpus/persuasion.txt"
BYTE = {"tokenizer": "byte"}
PROMPT = "Anne"


def _generate(capsys, source, *options) -> str:
    capsys.readouterr()
    assert main(["generate", str(source), "--prompt", PROMPT, "--tokens", "6", *options]) == 0
    return capsys.readouterr().out


def _one_line_error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def _reassemble(step, tmp_path, change):
    """A copy of checkpoint ``step`` edited by ``change(copy)``, its manifest rewritten so that it verifies: a
    checkpoint put together by hand, which only what it holds can expose."""
    copy = tmp_path / step.name
    shutil.copytree(step, copy)
    change(copy)
    (copy / "manifest.json").unlink()
    write_manifest(copy, step=json.loads((step / "manifest.json").read_text())["step"])
    return copy


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """The last checkpoint of a 2-step byte-tokenizer run from a tokenizer-less Qwen3 directory (vocab 384)."""
    tmp = tmp_path_factory.mktemp("byte-run")
    make_hf_model("Qwen3Config", "Qwen3ForCausalLM", tiny_settings("qwen3-qknorm-tied")).save_pretrained(tmp / "hf")
    (tmp / "corpus.txt").write_text(CORPUS.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    config = {
        "run": {"output_dir": str(tmp / "out")}, "model": {"load": f"hf:{tmp / 'hf'}"},
        "data": {"dataset": "text", "paths": [str(tmp / "corpus.txt")], "seq_length": 32},
        "training": {"steps": 2, "micro_batch_size": 2, "threads": 1}, "checkpoint": {"save_hf": True},
        "logging": {"progress": False, "tensorboard": False},
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["train", str(tmp / "run.yaml")]) == 0
    return tmp / "out" / "checkpoints" / "step-0000002"


@pytest.mark.slow
def test_the_byte_tokenizer_travels_through_checkpoints_exports_and_conversions(byte_run, tmp_path, capsys):
    step, export = byte_run, byte_run / "hf"
    assert json.loads((step / "tokenizer" / "loongforge_tokenizer.json").read_text()) == BYTE
    assert "tokenizer/loongforge_tokenizer.json" in json.loads((step / "manifest.json").read_text())["files"]
    assert json.loads((export / "loongforge_tokenizer.json").read_text()) == BYTE
    assert not (export / "tokenizer.json").exists()

    text = _generate(capsys, step)
    assert text.startswith(PROMPT) and text == _generate(capsys, step, "--tokenizer", "byte")
    assert _generate(capsys, export) == text  # the export alone: its descriptor names the tokenizer

    assert main(["convert", "mcore-to-hf", str(step), str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "loongforge_tokenizer.json").read_text()) == BYTE
    assert main(["convert", "hf-to-mcore", str(export), str(tmp_path / "mcore")]) == 0
    assert yaml.safe_load((tmp_path / "mcore" / "config.yaml").read_text())["data"]["tokenizer"] == "byte"
    assert json.loads((tmp_path / "mcore" / "hf_source" / "loongforge_tokenizer.json").read_text()) == BYTE
    assert _generate(capsys, tmp_path / "mcore") == text


def test_a_converted_checkpoint_without_a_tokenizer_claims_none_and_generate_asks_for_one(tmp_path, capsys):
    """The measured bug: a vocab-300 directory without tokenizer files converted to a checkpoint whose config.yaml
    said ``tokenizer: byte`` (259 ids fit 300 rows), and ``generate`` printed byte-decoded garbage with it."""
    hf_dir = tmp_path / "hf"
    make_hf_model("Qwen3Config", "Qwen3ForCausalLM",
                  {**tiny_settings("qwen3-qknorm-tied"), "vocab_size": 300}).save_pretrained(hf_dir)
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    assert yaml.safe_load((tmp_path / "mcore" / "config.yaml").read_text())["data"]["tokenizer"] == ""
    err = _one_line_error(capsys, ["generate", str(tmp_path / "mcore"), "--prompt", PROMPT, "--tokens", "2"])
    assert f"{tmp_path / 'mcore'}: carries no tokenizer" in err and "pass --tokenizer" in err
    # a checkpoint converted before tokenizers were carried recorded the default: still no claim generate believes
    claimed = _reassemble(tmp_path / "mcore", tmp_path / "old", lambda c: (c / "config.yaml").write_text(
        (c / "config.yaml").read_text().replace("tokenizer: ''", "tokenizer: byte")))
    err = _one_line_error(capsys, ["generate", str(claimed), "--prompt", PROMPT, "--tokens", "2"])
    assert f"{claimed}: carries no tokenizer" in err and "pass --tokenizer" in err
    assert _generate(capsys, tmp_path / "mcore", "--tokenizer", "byte").startswith(PROMPT)  # the user's choice


@pytest.mark.slow
def test_a_carried_tokenizer_that_disagrees_with_config_yaml_is_refused(byte_run, tmp_path, capsys):
    def describe_word_tokenizer(copy):
        (copy / "tokenizer" / "loongforge_tokenizer.json").write_text(json.dumps({"tokenizer": "word"}))

    mixed = _reassemble(byte_run, tmp_path / "mixed", describe_word_tokenizer)
    err = _one_line_error(capsys, ["generate", str(mixed), "--prompt", PROMPT, "--tokens", "2"])
    assert (f"{mixed}: carries tokenizer 'word' (tokenizer/loongforge_tokenizer.json) but its config.yaml says "
            "data.tokenizer 'byte'") in err
    err = _one_line_error(capsys, ["convert", "mcore-to-hf", str(mixed), str(tmp_path / "out")])
    assert "carries tokenizer 'word'" in err and not (tmp_path / "out").exists()
    # a training checkpoint from before tokenizers were carried: its config.yaml is what the run trained with
    older = _reassemble(byte_run, tmp_path / "older", lambda c: shutil.rmtree(c / "tokenizer"))
    assert _generate(capsys, older) == _generate(capsys, byte_run)
