"""Hundreds of malformed configs, generated from the shipped recipes, each give one line of error -- never a
traceback, never an OK -- from ``loongforge check`` and from ``loongforge train`` alike.

The set is deterministic: every key of every recipe renamed (an unknown key), every scalar given a value of the wrong
type, enum values misspelt, sizes made negative or zero, files that do not exist, sections that are not mappings, and
YAML that does not parse. ``check`` runs on all of them; ``train`` on every fifth (about 120), which stays fast because
``train`` runs the same pre-flight checks before it registers optimizations, creates a process group or builds a
model -- so a malformed config costs it milliseconds, and the test would time out if ``train`` reached the model.
Both run in this process through ``loongforge.cli.main``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from loongforge.cli import main

# The set is generated from every shipped recipe, most of them the plugins' models (and a dp-balance section).
pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
#: A value of the wrong type for each kind of leaf value a recipe holds.
WRONG_TYPE = {bool: "maybe", int: "many", float: "fast", str: {"not": "a string"}, list: {"not": "a list"}}
#: Keys whose value set to these makes an impossible run (recipes that lack the key get it added).
BAD_VALUES = [
    ("training.steps", 0), ("training.steps", -5), ("training.micro_batch_size", 0), ("logging.interval", 0),
    ("checkpoint.keep_last", -1), ("checkpoint.interval", -2), ("parallel.tp", 0), ("parallel.pp", -1),
    ("parallel.cp", 0), ("scheduler.decay", "cosin"), ("scheduler.decay", "exponential"),
    ("training.precision", "fp7"), ("training.loss_normalization", "per_sample"),
    ("parallel.strategy", "megatronn"), ("device", "no-such-device"), ("data.dataset", "no-such-dataset"),
    ("data.tokenizer", "no-such-tokenizer"),
    ("model.name", "no-such-model"), ("optimizations.no-such-opt", {}), ("device_options.bogus", 1),
    ("checkpoint.resume", "/nonexistent/step-0000001"), ("model.overrides.num_layerz", 2),
    ("task.bogus", 1), ("model.lora.rank", "low"),
    ("optimizer.lr", float("inf")), ("optimizer.lr", -1e-3), ("optimizer.min_lr", -1e-5), ("optimizer.beta2", 1.0),
    ("optimizer.eps", 0.0), ("optimizer.grad_clip", float("nan")), ("scheduler.warmup_steps", -1),
    ("scheduler.decay_steps", 0),
]
#: Settings only megatron models read (a task model builds its own data and has no experts to dispatch); names
#: (``data.dataset`` ...) must resolve whether the run reads them or not.
MEGATRON_BAD_VALUES = [("parallel.moe_dispatcher", "mail"), ("data.seq_length", 0), ("data.paths", ["missing.txt"]),
                       ("model.load", "hf:missing"), ("training.phase", "pretraining")]
#: Sections replaced by something that is not a mapping.
NOT_MAPPINGS = [("training", 5), ("run", [1, 2]), ("parallel", "sideways"), ("optimizations", ["dp-balance"]),
                ("device_options", 3), ("scheduler", True), ("task", "fast")]
#: Text changes that break the YAML itself.
JUNK = [("unclosed", lambda t: t + "\nextra: [1, 2\n"), ("tab", lambda t: t.replace("\n", "\n\t", 1)),
        ("scalar", lambda t: t.splitlines()[0].lstrip("# ") + "\n"), ("list", lambda t: f"- {t.splitlines()[0]!r}\n"),
        ("colon", lambda t: t + "\nrun: name: x\n")]


def _leaves(data: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _set(data: dict, path: tuple[str, ...], value: Any) -> dict:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        child = node.get(key)
        node[key] = child = {"name": child} if isinstance(child, str) and key == "model" else (child or {})
        node = child
    node[path[-1]] = value
    return data


def _rename(data: dict, path: tuple[str, ...]) -> dict:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[f"{path[-1]}x"] = node.pop(path[-1])
    return data


def _runnable(data: dict) -> dict:
    """The recipe as a test runs it: writing under the working directory, its data directory present (the
    Meta-World recipe names one a collect command writes), so each case fails for its own mutation alone."""
    data = _set(data, ("run", "output_dir"), "out")
    if (data.get("task") or {}).get("data"):
        data = _set(data, ("task", "data"), str(ROOT / "configs"))
    return data


def _engine(recipe: Path) -> str | None:
    """The step engine of the recipe's model (what decides which settings the run reads); ``None`` when the plugin
    that provides it is not installed (``nox -s tests_core``, which deselects this module, still collects it)."""
    from loongforge.config import load_config
    from loongforge.errors import LoongForgeError
    from loongforge.resolve import registered_family

    try:
        return registered_family(load_config(recipe)).engine
    except LoongForgeError:  # its model (or the family composing its parts) is not registered
        return None


def malformed() -> list[tuple[str, str]]:
    """``(case id, YAML text)`` of every generated config."""
    cases = []
    for recipe in RECIPES:
        text = recipe.read_text(encoding="utf-8")
        data = _runnable(yaml.safe_load(text))
        stem = recipe.stem
        for path, value in _leaves(data):
            key = ".".join(path)
            cases.append((f"{stem}:rename:{key}", _rename(data, path)))
            wrong = WRONG_TYPE.get(type(value))
            if wrong is not None:
                cases.append((f"{stem}:type:{key}", _set(data, path, wrong)))
        for key, value in BAD_VALUES + (MEGATRON_BAD_VALUES if _engine(recipe) == "megatron" else []):
            cases.append((f"{stem}:value:{key}={value}", _set(data, tuple(key.split(".")), value)))
        for key, value in NOT_MAPPINGS:
            cases.append((f"{stem}:section:{key}", {**data, key: value}))
        cases += [(f"{stem}:yaml:{name}", change(text)) for name, change in JUNK]
    return [(case, body if isinstance(body, str) else yaml.safe_dump(body, sort_keys=False)) for case, body in cases]


CASES = malformed()


def test_the_generated_set_is_large_and_distinct():
    assert len(CASES) >= 200
    assert len({case for case, _ in CASES}) == len(CASES) and len({text for _, text in CASES}) == len(CASES)


def _one_line_error(capsys, argv: list[str], path: Path) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code != 0 and not out.rstrip().endswith(": OK"), (argv, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], (argv, err)
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)

    def write(text: str) -> Path:
        path = tmp_path / "run.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


def test_the_unmutated_recipes_pass(config_file, capsys):
    for recipe in RECIPES:
        path = config_file(yaml.safe_dump(_runnable(yaml.safe_load(recipe.read_text(encoding="utf-8")))))
        assert main(["check", str(path)]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.endswith(f"{path}: OK\n")


@pytest.mark.parametrize("case,text", CASES, ids=[case for case, _ in CASES])
def test_check_refuses_in_one_line(config_file, capsys, case, text):
    path = config_file(text)
    _one_line_error(capsys, ["check", str(path)], path)


@pytest.mark.parametrize("case,text", CASES[::5], ids=[case for case, _ in CASES[::5]])
def test_train_refuses_with_the_line_check_gives(config_file, capsys, case, text):
    path = config_file(text)
    checked = _one_line_error(capsys, ["check", str(path)], path)
    assert _one_line_error(capsys, ["train", str(path)], path) == checked
    assert not (path.parent / "out").exists()  # refused before anything was written
