"""Hundreds of malformed configs generated from the shipped recipes (``configs/*.yaml``), every one of them wrong.

Each recipe is first made runnable in a test directory (:func:`runnable`: output under the working directory, the
Meta-World recipe's data a small LeRobot set there, :func:`write_runnable_data`), so a generated case fails for its
own mutation alone -- the test suite checks that the unmutated recipes pass. The mutations, all deterministic:

- every key renamed (an unknown key) and every scalar given a value of the wrong type;
- values no run can use (:data:`BAD_VALUES`: sizes zero or negative, optimizer and schedule values out of range,
  misspelt choices, unknown component names, files that do not exist, layouts that do not fit one process), and
  for task models each declared ``task:`` range overstepped and settings wrong for the model or its data
  (:mod:`fuzz_task_options`);
- sections that are not mappings, shorthands that mean nothing (``model: [a, b]``, ``parallel: sideways``);
- YAML that does not parse, or that parses into what a config must not hold: a key given twice (YAML would keep the
  last silently), nesting thousands deep, aliases that expand exponentially or into themselves;
- bytes that are not UTF-8 (Latin-1, UTF-16, a NUL), in the file and in ``key=value`` overrides;
- the same faults given as overrides on the command line.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from fuzz_task_options import RECIPE_BAD_SETTINGS, range_values

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
#: A value of the wrong type for each kind of leaf value a recipe holds.
WRONG_TYPE = {bool: "maybe", int: "many", float: "fast", str: {"not": "a string"}, list: {"not": "a list"}}
NAN, INF = float("nan"), float("inf")
#: Keys whose value set to these makes an impossible run, whatever the model (recipes that lack the key get it).
BAD_VALUES: list[tuple[str, Any]] = [
    # sizes and intervals
    ("training.steps", 0), ("training.steps", -5), ("training.steps", 2.5), ("training.micro_batch_size", 0),
    ("training.micro_batch_size", -8), ("logging.interval", 0), ("checkpoint.keep_last", -1),
    ("checkpoint.interval", -2), ("training.threads", 0), ("training.threads", -1), ("run.seed", -1),
    ("run.seed", 2**40), ("training.sample_tokens", -1), ("data.valid_fraction", 1.0),
    ("data.valid_fraction", -0.1), ("training.global_batch_size", 0), ("training.global_batch_size", -16),
    # optimizer and schedule
    ("optimizer.name", "sgd"), ("optimizer.lr", INF), ("optimizer.lr", NAN), ("optimizer.lr", -1e-3),
    ("optimizer.min_lr", -1e-5), ("optimizer.min_lr", 10.0), ("optimizer.weight_decay", -0.1),
    ("optimizer.weight_decay", NAN), ("optimizer.weight_decay", INF), ("optimizer.beta1", 1.0),
    ("optimizer.beta1", -0.1), ("optimizer.beta2", 1.0), ("optimizer.beta2", NAN), ("optimizer.eps", 0.0),
    ("optimizer.eps", -1e-8), ("optimizer.eps", INF), ("optimizer.grad_clip", -1.0),
    ("optimizer.grad_clip", NAN), ("scheduler.warmup_steps", -1), ("scheduler.decay_steps", 0),
    ("scheduler.decay_steps", -3), ("scheduler.decay", "cosin"), ("scheduler.decay", "exponential"),
    # choices
    ("training.precision", "fp7"), ("training.loss_normalization", "per_sample"),
    ("training.on_nonfinite", "explode"), ("checkpoint.verify", "some"), ("training.spike_factor", 0.5),
    ("training.spike_window", 0), ("training.max_recoveries", -1), ("parallel.cp_mode", "spiral"),
    # parallel layouts that cannot fit one process, or a strategy that does not exist
    ("parallel.tp", 0), ("parallel.pp", -1), ("parallel.cp", 0), ("parallel.tp", 2), ("parallel.pp", 2),
    ("parallel.strategy", "megatronn"),
    # names nothing registered
    ("device", "no-such-device"), ("data.dataset", "no-such-dataset"), ("data.tokenizer", "no-such-tokenizer"),
    ("model.name", "no-such-model"), ("optimizations.no-such-opt", {}), ("device_options.bogus", 1),
    ("model.overrides.num_layerz", 2), ("task.bogus", 1), ("model.lora.rank", "low"),
    # files that do not exist
    ("checkpoint.resume", "/nonexistent/step-0000001"), ("model.name", "no_such_module_lf:factory"),
    ("parallel.planner.margin", 2.0),
]
#: Settings only megatron models read (a task model builds its own data and has no experts to dispatch); names
#: (``data.dataset`` ...) must resolve whether the run reads them or not.
MEGATRON_BAD_VALUES: list[tuple[str, Any]] = [
    ("parallel.moe_dispatcher", "mail"), ("data.seq_length", 0), ("data.seq_length", -64),
    ("data.seq_length", 10**6), ("data.paths", ["missing.txt"]), ("model.load", "hf:missing"),
    ("model.load", "/nonexistent/checkpoint"), ("data.tokenizer", "hf:/nonexistent/tokenizer"),
    ("training.phase", "pretraining"), ("parallel.vpp", 2),
    ("parallel.sequence_parallel", True), ("parallel.cp", 2), ("parallel.ep", 2),
    ("parallel.strategy", "fsdp2"), ("parallel.strategy", "ddp"), ("parallel.strategy", "hsdp"),
    ("model.lora.rank", 0), ("model.lora.alpha", NAN), ("model.lora.dropout", 1.5), ("model.lora.targets", ["qkv"]),
    ("model.recompute.granularity", "some"), ("model.recompute.num_layers", -1), ("parallel.ddp_bucket_mb", 0.0),
    ("parallel.cp_a2a_size", 2),
]
#: Settings wrong only together (each alone is fine), for megatron models.
MEGATRON_BAD_COMBINATIONS: list[tuple[str, dict[str, Any]]] = [
    ("global-batch-not-a-multiple", {"training.micro_batch_size": 4, "training.global_batch_size": 6}),
    ("min-lr-above-lr", {"optimizer.lr": 1e-4, "optimizer.min_lr": 1e-3}),
    ("pp-more-than-layers", {"parallel.pp": 8, "model.overrides.num_layers": 2}),
    ("selective-recompute-of-nothing", {"model.recompute.granularity": "selective", "model.recompute.modules": []}),
]
#: Settings of task models (torch-native strategies; their data named in ``task:``).
TASK_BAD_VALUES: list[tuple[str, Any]] = [
    ("parallel.strategy", "hsdp"), ("parallel.fsdp_shard_size", 0), ("parallel.ddp_bucket_mb", -25.0),
    ("parallel.ddp_comm_hook", "zip"), ("training.precision", "fp8"),
    ("training.loss_normalization", "global_tokens"), ("task.data", "/nonexistent/dataset"),
    ("task.held_out_episodes", 1000), ("parallel.cp_mode", "ring"),
]
#: Sections replaced by something that is not a mapping, and shorthands that mean nothing.
NOT_MAPPINGS: list[tuple[str, Any]] = [
    ("training", 5), ("run", [1, 2]), ("parallel", "sideways"), ("parallel", True), ("optimizations", ["dp-balance"]),
    ("device_options", 3), ("scheduler", True), ("task", "fast"), ("model", ["llama-tiny", "qwen3-tiny"]),
    ("model", 5), ("data", "shipped-corpus"), ("checkpoint", [None]),
]
#: Text changes that break the YAML itself.
JUNK: list[tuple[str, Callable[[str], str]]] = [
    ("unclosed", lambda t: t + "\nextra: [1, 2\n"), ("tab", lambda t: t.replace("\n", "\n\t", 1)),
    ("scalar", lambda t: t.splitlines()[0].lstrip("# ") + "\n"), ("list", lambda t: f"- {t.splitlines()[0]!r}\n"),
    ("colon", lambda t: t + "\nrun: name: x\n"), ("two-documents", lambda t: t + "\n---\nrun: {name: x}\n"),
    ("undefined-alias", lambda t: t + "\nextra: *nowhere\n"), ("unhashable-key", lambda t: t + "\n? [a, b]\n: 1\n"),
    ("integer-too-long", lambda t: t + "\nextra: 1" + "0" * 5000 + "\n"),
]
#: Values for the (scalar) ``device`` key that a config must not hold: nesting and aliases gone wild.
DEEP = 3000
#: The one deep shape that is slow to refuse: PyYAML's scanner looks up to 1024 characters ahead for a key at every
#: ``[``, about half a second in all, before the composer reaches the depth limit. Generated for one recipe only.
DEEP_LIST = "[" * DEEP + "]" * DEEP
WILD_VALUES: list[tuple[str, str]] = [
    ("deep-flow-mapping", "{a: " * DEEP + "1" + "}" * DEEP),
    ("deep-block-mapping", "".join(f"\n{' ' * (i + 1)}k{i}:" for i in range(300)) + " 1"),  # 300 x 300 columns
    ("alias-bomb", "[" + ", ".join([f"&a0 [{', '.join(['x'] * 10)}]"]
                                   + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]) + "]"),
    ("recursive-alias", "&loop [*loop]"),
    ("alias-chain", "[&c0 [1], " + ", ".join(f"&c{i} [*c{i - 1}]" for i in range(1, 400)) + "]"),
]
#: ``key=value`` overrides that are wrong by themselves, given after each recipe.
BAD_OVERRIDES: list[tuple[str, str]] = [
    ("no-equals", "training.steps"), ("empty-key", "=5"), ("duplicate-in-value", "training={steps: 2, steps: 5000}"),
    ("deep-value", "device=" + "{a: " * DEEP + "1" + "}" * DEEP), ("recursive-value", "device=&r [*r]"),
    ("not-utf8", "run.name=caf\udce9"), ("not-a-section", "run.seed.value=1"), ("unknown-key", "training.stepz=3"),
    ("wrong-type", "training.steps=many"), ("nan-lr", "optimizer.lr=.nan"), ("inf-eps", "optimizer.eps=-.inf"),
    ("float-overflow", "optimizer.lr=1" + "0" * 400), ("threads-overflow", "training.threads=" + "9" * 40),
]
_SCALAR_LINE = re.compile(r"^(\s*)([A-Za-z_][\w.-]*): (?![|>])\S")


@dataclass(frozen=True)
class MalformedConfig:
    """One generated case: the file's bytes and the overrides given after it."""

    name: str
    body: bytes
    overrides: tuple[str, ...] = ()


#: Where :func:`runnable` points a recipe's ``task.data`` (relative: the working directory of the run holds it).
TASK_DATA = "task-data"


def runnable(data: dict) -> dict:
    """The recipe as a test runs it: writing under the working directory, from the seed's weights where it starts
    from another recipe's checkpoint (the post-training ones load ``runs/sft-tiny``; the faults here are the
    recipe's own keys) and, for a recipe that names a LeRobot dataset (the Meta-World one names what a collect
    command writes), reading :data:`TASK_DATA` there."""
    data = set_key(data, ("run", "output_dir"), "out")
    if isinstance(data.get("model"), dict):
        data["model"].pop("load", None)
    if (data.get("task") or {}).get("data"):
        data = set_key(data, ("task", "data"), TASK_DATA)
    return data


def write_runnable_data(workdir: Path) -> None:
    """The data :func:`runnable` recipes read from ``workdir``: six short episodes (the Meta-World recipe holds five
    out and trains on the sixth, whose 40 frames fill its batch of 32), when the embodied plugin is installed."""
    import importlib.util

    if importlib.util.find_spec("loongforge_embodied") is None:
        return
    from loongforge_embodied.data.synthetic import write_synthetic_dataset

    write_synthetic_dataset(workdir / TASK_DATA, version="v3.0", codec="png", lengths=[40] * 6)


def set_key(data: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of ``data`` with the key ``path`` set (sections created, ``model: NAME`` expanded on the way)."""
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        child = node.get(key)
        node[key] = child = {"name": child} if isinstance(child, str) and key == "model" else (child or {})
        node = child
    node[path[-1]] = value
    return data


def _leaves(data: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _rename(data: dict, path: tuple[str, ...]) -> dict:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[f"{path[-1]}x"] = node.pop(path[-1])
    return data


def _engine(recipe: Path) -> tuple[str | None, type | None]:
    """The step engine of the recipe's model (what decides which settings the run reads) and its ``task_options``
    dataclass; ``(None, None)`` when the plugin that provides it is not installed."""
    from loongforge.config import load_config
    from loongforge.errors import LoongForgeError
    from loongforge.resolve import registered_family

    try:
        family = registered_family(load_config(recipe))
    except LoongForgeError:  # its model (or the family composing its parts) is not registered
        return None, None
    return family.engine, type(family).task_options


def _dump(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def _duplicated_lines(text: str) -> Iterator[tuple[str, str]]:
    """``(key, text)`` with one ``key: value`` line written twice in its mapping, for every such line of ``text``
    (the second copy changes nothing but is still a key given twice)."""
    lines = text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        match = _SCALAR_LINE.match(line)
        if match:
            yield f"{index}:{match.group(2)}", "".join(lines[: index + 1] + [line] + lines[index + 1:])


def malformed_configs() -> list[MalformedConfig]:
    """Every generated case, named ``recipe:mutation:detail``; names and bodies are all distinct."""
    cases: list[MalformedConfig] = []

    def add(name: str, body: str | bytes | dict, *overrides: str) -> None:
        if isinstance(body, dict):
            body = _dump(body)
        cases.append(MalformedConfig(name, body.encode("utf-8") if isinstance(body, str) else body, overrides))

    for recipe in RECIPES:
        original = recipe.read_text(encoding="utf-8")
        data = runnable(yaml.safe_load(original))
        text, stem, (engine, options) = _dump(data), recipe.stem, _engine(recipe)
        for path, value in _leaves(data):
            key = ".".join(path)
            add(f"{stem}:rename:{key}", _rename(data, path))
            wrong = WRONG_TYPE.get(type(value))
            if wrong is not None:
                add(f"{stem}:type:{key}", set_key(data, path, wrong))
        extra = {"megatron": MEGATRON_BAD_VALUES, "task": TASK_BAD_VALUES}.get(engine or "", [])
        for key, value in BAD_VALUES + extra:
            add(f"{stem}:value:{key}={value}", set_key(data, tuple(key.split(".")), value))
        combinations = MEGATRON_BAD_COMBINATIONS if engine == "megatron" else RECIPE_BAD_SETTINGS.get(stem, [])
        for name, settings in combinations:
            changed = data
            for key, value in settings.items():
                changed = set_key(changed, tuple(key.split(".")), value)
            add(f"{stem}:value:{name}", changed)
        for key, value in range_values(options) if options is not None else []:
            add(f"{stem}:range:{key}={value}", set_key(data, tuple(key.split(".")), value))
        for key, value in NOT_MAPPINGS:
            add(f"{stem}:section:{key}={value}", {**data, key: value})
        for name, change in JUNK:
            add(f"{stem}:yaml:{name}", change(original))
        for where, duplicated in _duplicated_lines(text):
            add(f"{stem}:duplicate:{where}", duplicated)
        add(f"{stem}:duplicate:section", text + f"run:\n  name: {stem}-again\n")
        without_device = _dump({k: v for k, v in data.items() if k != "device"})
        for name, value in WILD_VALUES:
            add(f"{stem}:wild:{name}", without_device + f"device: {value}\n")
        if stem == "quickstart":
            add(f"{stem}:wild:deep-flow-list", without_device + f"device: {DEEP_LIST}\n")
            add(f"{stem}:override:deep-list-value", text, f"device={DEEP_LIST}")
        add(f"{stem}:encoding:latin-1", text.encode("utf-8") + "# café\n".encode("latin-1"))
        add(f"{stem}:encoding:utf-16", text.encode("utf-16"))
        add(f"{stem}:encoding:nul", text.encode("utf-8") + b"# a NUL: \x00\n")
        for name, override in BAD_OVERRIDES:
            add(f"{stem}:override:{name}", text, override)
    return cases
