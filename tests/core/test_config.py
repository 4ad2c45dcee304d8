"""Config loading: strict keys, types, shorthands and overrides, with file and key in every error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from loongforge.config import config_to_dict, load_config
from loongforge.config.sections import build_section
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


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'training.stepz' \(known keys here: steps, .*\); "
                                          r"did you mean 'steps'\?"):
        load_config(write(tmp_path, "training: {stepz: 5}\n"))


def test_parts_are_the_other_keys_of_model_and_round_trip(tmp_path):
    import yaml

    cfg = load_config(write(tmp_path, "model: {encoder: siglip-tiny, foundation: {num_layers: 2}}\n"))
    assert cfg.model.name is None and cfg.model.parts == {"encoder": "siglip-tiny", "foundation": {"num_layers": 2}}
    saved = config_to_dict(cfg)["model"]
    assert saved["encoder"] == "siglip-tiny" and "roles" not in saved
    again = load_config(write(tmp_path, yaml.safe_dump(config_to_dict(cfg))))
    assert again.model.parts == cfg.model.parts
    named = load_config(None, ["model.name=llama-tiny", "model.foundation=qwen3-tiny"])
    assert named.model.name == "llama-tiny" and named.model.parts == {"foundation": "qwen3-tiny"}


@dataclass(frozen=True)
class Inner:
    low: float
    high: float = 1.0

    def __post_init__(self):
        if self.low >= self.high:
            raise ConfigError(f"low must be below high, got {self.low} >= {self.high}")


@dataclass(frozen=True)
class Section:
    graphs: bool | Literal["none", "local"] = False
    window: tuple[int, int] = (0, 1)
    sizes: tuple[int, ...] = ()
    inner: Inner | None = None
    names: list[str] = field(default_factory=list)
    by_name: dict[str, int] = field(default_factory=dict)


@pytest.mark.parametrize("data,expected", [
    ({"graphs": True}, Section(graphs=True)),
    ({"graphs": "local", "window": [2, 3], "sizes": [1, 2, 3]},
     Section(graphs="local", window=(2, 3), sizes=(1, 2, 3))),
    ({"inner": {"low": 0}, "names": "a", "by_name": {"x": 1}},
     Section(inner=Inner(0.0), names=["a"], by_name={"x": 1})),
])
def test_sections_convert_unions_tuples_nested_and_mappings(data, expected):
    assert build_section(Section, data, "x.yaml", "sec") == expected


@pytest.mark.parametrize("data,message", [
    ({"graphs": "loacl"}, "x.yaml: 'sec.graphs' must be true or false or one of none, local, got 'loacl'; "
                          "did you mean 'local'?"),
    ({"window": [1, 2, 3]}, "x.yaml: 'sec.window' must be a list of 2 values, got [1, 2, 3]"),
    ({"sizes": [1, "b"]}, "x.yaml: 'sec.sizes' must be an integer, got 'b'"),
    ({"inner": {"high": 2}}, "x.yaml: 'sec.inner.low' is required (in 'sec.inner')"),
    ({"inner": {"low": 3, "high": 2}}, "x.yaml: sec.inner: low must be below high, got 3.0 >= 2.0"),
    ({"by_name": {"x": "one"}}, "x.yaml: 'sec.by_name.x' must be an integer, got 'one'"),
    ({"names": {"a": 1}}, "x.yaml: 'sec.names' must be a list, got {'a': 1}"),
    ("five", "x.yaml: 'sec' must be a mapping, got 'five'"),
])
def test_section_errors_name_the_file_and_full_key(data, message):
    with pytest.raises(ConfigError) as error:
        build_section(Section, data, "x.yaml", "sec")
    assert str(error.value) == message


def test_null_parts_are_unset_as_older_saved_configs_wrote_them(tmp_path):
    cfg = load_config(write(tmp_path, "model: {name: llama-tiny, encoder: null, projector: null, foundation: null}\n"))
    assert cfg.model.name == "llama-tiny" and cfg.model.parts == {}
