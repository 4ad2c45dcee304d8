"""A config may start from others (``base:``) and ``check --print-config`` shows what resolved."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from loongforge.cli import main
from loongforge.config import load_config
from loongforge.config.loader import config_to_dict
from loongforge.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _write(path, text: str):
    path.write_text(text)
    return path


def test_bases_are_laid_under_the_file_key_by_key(tmp_path):
    _write(tmp_path / "common.yaml", "model: {name: llama-tiny, overrides: {num_layers: 3}}\n"
                                     "training: {steps: 5, micro_batch_size: 2}\ndata: {seq_length: 64}\n")
    _write(tmp_path / "short.yaml", "base: common.yaml\ntraining: {steps: 2}\nlogging: {interval: 1}\n")
    _write(tmp_path / "run.yaml", "base: [short.yaml]\nmodel: {overrides: {hidden_size: 128}}\n"
                                  "data: {seq_length: 32}\n")
    config = load_config(tmp_path / "run.yaml", ["training.micro_batch_size=4"])
    assert config.model.name == "llama-tiny"
    assert config.model.overrides == {"num_layers": 3, "hidden_size": 128}  # mappings merge
    assert (config.training.steps, config.training.micro_batch_size) == (2, 4)  # base < file < command line
    assert (config.data.seq_length, config.logging.interval) == (32, 1)


@pytest.mark.parametrize(("text", "message"), [
    ("base: missing.yaml\n", "base 'missing.yaml': no such config file"),
    ("base: [1]\n", "base must name a config file or a list of them"),
    ("base: self.yaml\n", "the configs name each other in a circle"),
])
def test_bad_bases_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path / "self.yaml", text))


def test_print_config_shows_what_a_run_records(tmp_path, capsys):
    """The resolved config first (bases merged, overrides applied, defaults filled: what checkpoints record), then
    the checks' lines."""
    path = _write(tmp_path / "run.yaml", f"base: {QUICKSTART}\ntraining: {{steps: 3}}\n")
    assert main(["check", str(path), "--print-config", "optimizer.lr=0.01"]) == 0
    expected = yaml.safe_dump(config_to_dict(load_config(path, ["optimizer.lr=0.01"])), sort_keys=False)
    out = capsys.readouterr().out
    assert out.startswith(expected) and out.rstrip().endswith(f"{path}: OK")
    printed = yaml.safe_load(expected)
    assert printed["training"]["steps"] == 3 and printed["optimizer"]["lr"] == 0.01
    assert printed["model"]["name"] == "llama-tiny"  # from the base


@pytest.mark.parametrize("text", ["", "# just a comment\n", "\n\n"])
def test_an_empty_config_file_is_refused_not_trained_with_defaults(tmp_path, text):
    """A failed shell redirect leaves an empty file; training the default model from it (into ./runs) would hide
    the mistake."""
    with pytest.raises(ConfigError, match="the config file holds no settings"):
        load_config(_write(tmp_path / "run.yaml", text))
    assert load_config(tmp_path / "run.yaml", ["training.steps=3"]).training.steps == 3  # settings given here
