"""The fuzz set: hundreds of malformed configs and dozens of malformed data sets through ``loongforge check`` and
``loongforge train``, each of which must end in exactly one ``error:`` line on stderr with exit status 2 -- no
traceback, no hang, no run that goes ahead -- and the counts printed (``fuzz: ...`` in the test output).

What is generated: :mod:`fuzz_configs` (mutations of every shipped recipe; for task models also every declared
``task:`` range overstepped and settings wrong for the model, :mod:`fuzz_task_options`), :mod:`fuzz_data` (core's
indexed, text and chat data broken one way at a time, plus the embodied plugin's LeRobot fault catalogue) and
:mod:`fuzz_plugin_data` (diffusion files and latent caches, VLM image-text sources, LeRobot sets a policy cannot
train on); how a run is judged:
:mod:`fuzz_harness` (in-process, under an alarm; ``train`` of a core case must refuse in pre-flight, before any
model exists). The controls -- the unmutated recipes and the valid originals of the data -- must pass, so each
case fails for its own fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fuzz_configs import RECIPES, malformed_configs, runnable, write_runnable_data
from fuzz_data import FAULTS, data_cases, lerobot_cases, valid_data_cases
from fuzz_harness import COMMANDS, Case, Outcome, failures, run, run_all, summary
from fuzz_plugin_data import CODE_RAN, diffusion_cases, policy_cases, vlm_cases
from loongforge.config import strict_yaml

# The configs are generated from every shipped recipe, most of them the plugins' models.
pytestmark = pytest.mark.needs_plugins

CONFIGS = malformed_configs()
#: Outcomes of each set, run once per session by whichever test asks first (the summary asks for both).
_OUTCOMES: dict[str, list[Outcome]] = {}
#: Where each set was written and run.
_ROOTS: dict[str, Path] = {}


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)


def _config_cases(root) -> list[Case]:
    """Every generated config written to ``root``, which is also where they run (and hold the data they name)."""
    write_runnable_data(root)
    cases = []
    for index, config in enumerate(CONFIGS):
        path = root / f"{index:04d}.yaml"
        path.write_bytes(config.body)
        # a fault given as an override is blamed on the command line, one in the file on the file
        where = "command line" if config.overrides else str(path)
        cases.append(Case(config.name, (str(path), *config.overrides), root, (where,)))
    return cases


def _outcomes(name: str, tmp_path_factory, capfd) -> list[Outcome]:
    if name not in _OUTCOMES:
        root = tmp_path_factory.mktemp(f"fuzz-{name}")
        if name == "configs":
            cases = _config_cases(root)
        else:
            cases = (data_cases(root / "core") + lerobot_cases(root / "lerobot") + diffusion_cases(root / "diffusion")
                     + vlm_cases(root / "vlm") + policy_cases(root / "embodied"))
        _OUTCOMES[name] = run_all(cases, capfd)
        _ROOTS[name] = root
    return _OUTCOMES[name]


def _disagreements(outcomes: list[Outcome]) -> list[str]:
    """Cases refused in pre-flight whose ``train`` line differs from ``check``'s (the two must run the same checks)."""
    by_case: dict[str, dict[str, Outcome]] = {}
    for outcome in outcomes:
        by_case.setdefault(outcome.case.name, {})[outcome.command] = outcome
    return [f"{name}: check {pair['check'].error_line!r} / train {pair['train'].error_line!r}"
            for name, pair in by_case.items()
            if pair["check"].case.before_model and pair["check"].error_line != pair["train"].error_line]


def _line(label: str, outcomes: list[Outcome]) -> str:
    counts = summary(outcomes)
    seconds = sum(o.seconds for o in outcomes)
    return (f"fuzz: {label}: {counts['tracebacks']} tracebacks, {counts['hangs']} hangs, {counts['accepted']} "
            f"accepted, {counts['badly_reported']} badly reported ({counts['runs']} runs, {seconds:.1f} s)")


#: The failures issue 17 reported, as ``(config text, overrides, the error after "error: {path}")`` (after
#: "error: command line" where an override is at fault).
REPORTED = [
    (b"model: llama-tiny\nrun:\n  name: caf\xe9\n", (),
     ":3: not valid UTF-8 (byte 0xe9 at offset 34); save the file as UTF-8"),
    (f"model: llama-tiny\nrun: {'[' * 3000}{']' * 3000}\n".encode(), (), ":2: nested deeper than 100 levels"),
    (b"model: llama-tiny\ntraining:\n  steps: 2\n  micro_batch_size: 2\n  steps: 5000\n", (),
     ":5: duplicate key 'training.steps' (first given on line 3); YAML would silently keep only the last value"),
    (b"model: llama-tiny\n", ("training={steps: 2, steps: 5000}",),
     ": override 'training={steps: 2, steps: 5000}': duplicate key 'steps' (first given on line 1); YAML would "
     "silently keep only the last value"),
    (b"model: llama-tiny\nparallel: {strategy: fsdp2}\n", (),
     ": strategy 'fsdp2' lays out task-engine models, but model 'llama-tiny' is trained by the megatron engine "
     "(`loongforge list strategies`)"),
    (b"model: llama-tiny\noptimizer: {weight_decay: .nan}\n", (),
     ": optimizer.weight_decay must be a finite number >= 0, got nan"),
    (b"model: llama-tiny\n", ("optimizer.beta2=1",), ": optimizer.beta2 must be in [0, 1), got 1.0"),
    (b"model: llama-tiny\n", ("training.threads=0",),
     ": training.threads must be an integer >= 1 (or unset: torch's default), got 0"),
    (b"model: llama-tiny\n", ("run.seed=-1",), ": run.seed must be an integer in [0, 2147483648), got -1"),
]


@pytest.mark.parametrize("body,overrides,message", REPORTED, ids=[m.split(":")[-1][:40] for *_, m in REPORTED])
def test_the_reported_failures_are_one_line(tmp_path, capfd, body, overrides, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(body)
    case = Case("reported", (str(path), *overrides), tmp_path)
    for command in COMMANDS:
        outcome = run(case, command, capfd)
        assert outcome.problem() is None, outcome.problem()
        if overrides:  # a malformed override is the command line's, a bad value the override that gave it
            where = "command line" if message.startswith(": override") else f"command line ({overrides[0]})"
        else:
            where = f"parallel.strategy in {path}" if "fsdp2" in message else str(path)
        assert outcome.error_line == f"error: {where}{message}"


def test_the_strict_loader_reads_what_safe_load_reads():
    """Every shipped recipe, and a merge that overrides merged keys, load as ``yaml.safe_load`` loads them."""
    merged = "base: &b {steps: 2, micro_batch_size: 4}\ntraining:\n  <<: *b\n  steps: 3\n"
    for text in [recipe.read_text(encoding="utf-8") for recipe in RECIPES] + [merged]:
        assert strict_yaml.load(text) == yaml.safe_load(text)
    assert strict_yaml.load(merged)["training"] == {"steps": 3, "micro_batch_size": 4}


def test_the_generated_sets_are_large_and_distinct():
    assert len(CONFIGS) >= 300 and len(FAULTS) >= 30
    assert len({c.name for c in CONFIGS}) == len(CONFIGS)
    assert len({(c.body, c.overrides) for c in CONFIGS}) == len(CONFIGS)
    assert len({f.name for f in FAULTS}) == len(FAULTS)
    kinds = {c.name.split(":")[1] for c in CONFIGS}
    assert {"rename", "type", "value", "range", "section", "yaml", "duplicate", "wild", "encoding", "override"} <= kinds


def test_the_originals_pass(tmp_path, capfd):
    """The controls: each unmutated recipe and each valid original of the data passes ``check``, and ``train``
    gets past pre-flight (where the harness stops it) -- so a refusal above is the fault's, not the setting's."""
    write_runnable_data(tmp_path)
    cases = []
    for recipe in RECIPES:
        path = tmp_path / f"{recipe.stem}.yaml"
        path.write_text(yaml.safe_dump(runnable(yaml.safe_load(recipe.read_text(encoding="utf-8")))))
        cases.append(Case(recipe.stem, (str(path),), tmp_path))
    cases += valid_data_cases(tmp_path / "data")
    for case in cases:
        checked, trained = (run(case, command, capfd) for command in COMMANDS)
        assert checked.code == 0 and checked.out.endswith(f"{case.argv[0]}: OK\n"), (case.name, checked.err)
        assert trained.past_preflight and not trained.err, (case.name, trained.err)


@pytest.mark.slow
def test_malformed_configs_are_refused_in_one_line(tmp_path_factory, capfd):
    outcomes = _outcomes("configs", tmp_path_factory, capfd)
    with capfd.disabled():
        print(f"\n{_line(f'{len(CONFIGS)} configs x {{check,train}}', outcomes)}")
    assert summary(outcomes)["runs"] == 2 * len(CONFIGS)
    assert not failures(outcomes), failures(outcomes)
    assert not _disagreements(outcomes), _disagreements(outcomes)[:20]


def test_malformed_datasets_are_refused_in_one_line(tmp_path_factory, capfd, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("fuzz-cache")))  # text corpora cache here
    outcomes = _outcomes("data", tmp_path_factory, capfd)
    with capfd.disabled():
        print(f"\n{_line(f'{len(outcomes) // 2} datasets x {{check,train}}', outcomes)}")
    assert not failures(outcomes), failures(outcomes)
    assert not _disagreements(outcomes), _disagreements(outcomes)[:20]
    assert not list(_ROOTS["data"].rglob(CODE_RAN)), "a data file's pickled code ran"


def _tally(outcomes: list[Outcome], part: int) -> dict[str, int]:
    """Cases per the ``part``-th field of their names (the recipe of a config, the kind of a data set)."""
    counts: dict[str, int] = {}
    for outcome in outcomes[::2]:
        key = outcome.case.name.split(":")[part]
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
def test_fuzz_counts(tmp_path_factory, capfd, monkeypatch):
    """The acceptance line of the issue: at least 300 configs and 40 data sets (LLM text and chat, VLM image-text,
    diffusion, LeRobot), both commands, all refused cleanly."""
    monkeypatch.setenv("LOONGFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("fuzz-cache")))
    configs, data = (_outcomes(name, tmp_path_factory, capfd) for name in ("configs", "data"))
    totals = summary(configs + data)
    recipes, kinds = _tally(configs, 0), _tally(data, 0)
    with capfd.disabled():
        print(f"\nfuzz: {len(configs) // 2} configs x {{check,train}}, {len(data) // 2} datasets: "
              f"{totals['tracebacks']} tracebacks, {totals['hangs']} hangs, {totals['accepted']} accepted, "
              f"{totals['badly_reported']} badly reported")
        print(f"fuzz: configs per recipe {recipes}; datasets per kind {kinds}")
    assert len(configs) // 2 >= 300 and len(data) // 2 >= 40
    assert set(recipes) == {recipe.stem for recipe in RECIPES}
    assert set(kinds) >= {"indexed", "text", "chat", "lerobot", "diffusion", "vlm", "embodied"}
    assert totals == {"runs": len(configs) + len(data), "tracebacks": 0, "hangs": 0, "accepted": 0,
                      "badly_reported": 0}, failures(configs + data)
