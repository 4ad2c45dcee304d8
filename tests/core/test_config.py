"""Config loading: strict keys, types, shorthands and overrides, with file and key in every error."""

from __future__ import annotations

import pytest
from loongforge.config import config_to_dict, load_config
from loongforge.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_sections_and_model_shorthand(tmp_path):
    cfg = load_config(write(tmp_path, "model: qwen3-0.6b\nparallel: {tp: 2}\noptimizer: {lr: 3e-4}\n"))
    assert cfg.model.name == "qwen3-0.6b"
    assert cfg.parallel.tp == 2 and cfg.parallel.pp == 1
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.source.endswith("run.yaml")


def test_overrides_apply_after_file(tmp_path):
    cfg = load_config(
        write(tmp_path, "model: llama-tiny\ntraining: {steps: 5}\n"),
        ["training.steps=7", "model.overrides.num_layers=2", "data.paths=[a.txt, b.txt]", "run.name=x"],
    )
    assert cfg.training.steps == 7
    assert cfg.model.name == "llama-tiny" and cfg.model.overrides == {"num_layers": 2}
    assert cfg.data.paths == ["a.txt", "b.txt"]
    assert cfg.run.name == "x"


def test_unknown_key_names_file_and_path(tmp_path):
    path = write(tmp_path, "training:\n  stepz: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "'training.stepz'" in message and "steps" in message
    assert "\n" not in message


def test_wrong_type_is_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"'training.steps' must be an integer"):
        load_config(write(tmp_path, "training: {steps: many}\n"))
    with pytest.raises(ConfigError, match=r"'logging.tensorboard' must be true or false"):
        load_config(write(tmp_path, "logging: {tensorboard: 3}\n"))


def test_bad_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"run.yaml:2: invalid YAML"):
        load_config(write(tmp_path, "model: a\n  bad: [\n"))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["training.steps"])
    with pytest.raises(ConfigError, match="unknown key 'nosuch'"):
        load_config(None, ["nosuch=1"])


def test_round_trip_through_dict(tmp_path):
    import yaml

    cfg = load_config(None, ["training.steps=3", "parallel.tp=2"])
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    again = load_config(path)
    assert config_to_dict(again) == config_to_dict(cfg)
