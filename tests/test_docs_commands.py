"""The commands the documentation shows are the commands that work, in both languages.

Every ``bash`` / ``console`` block of README.md and docs/**/*.md is read: in a ``bash`` block every line that is not
blank or a comment is a command (a trailing ``\\`` continues it); in a ``console`` block the ``$ `` lines are the
commands and the rest is their recorded output (numbers compared up to rounding, :data:`RECORDED_RTOL`: the guides
record one machine's kernels).

- The Simplified Chinese files (``docs/zh/README.md`` for README.md, ``docs/zh/X.md`` for ``docs/X.md``) must show
  exactly the English file's commands, in the same order (comments may be translated, so commands are compared as
  the shell's words with comments dropped), and their ``console`` blocks -- commands and output -- byte for byte.
  Running the English commands therefore runs the Chinese ones.
- Every English file's commands run in document order, as a user copy-pasting them would, with ``bash`` in a fresh
  directory of their own (holding links to the repository's ``configs/`` and ``loongforge-core/``, which the
  commands name as paths in a checkout), and each must exit 0. The guides are written so that the documented
  commands are cheap as they stand; :data:`CHEAP` appends short-run overrides to the few reference commands that
  would train for minutes.
- A command that cannot run here (it installs from the network, needs a GPU, a cluster or downloaded weights, or
  is a synopsis with placeholders) is listed in :data:`EXCLUDED` with the reason; an entry that matches no
  documented command fails the test, so the table cannot outlive the docs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ZH = Path("docs/zh")

#: Reasons a documented command is not run.
NETWORK = "installs packages from an index (no network in the test)"
SUITE = "runs the test suite or a benchmark itself"
CLUSTER = "needs a cluster (several nodes, Slurm, Kubernetes, docker)"
WEIGHTS = "needs a published checkpoint downloaded beforehand"
NETWORK_MODEL = "downloads a published model from the Hugging Face Hub (tests/core/test_hub_ids.py runs it offline)"
SYNOPSIS = "a synopsis with placeholders (CONFIG, N, ...), not a command to paste"
SERVER = "a tool that serves until stopped (TensorBoard)"
LIBERO = ("needs the [libero] extra (350 MB of LIBERO assets) and half an hour of a busy CPU; "
          "tests/embodied/test_sim_adapters.py runs the same path against a FAKE LIBERO")

#: file -> {beginning of a command: why it is not run}. A command is excluded by the first entry it starts with.
EXCLUDED: dict[str, dict[str, str]] = {
    "README.md": {
        "pip install": NETWORK,
    },
    "docs/certify.md": {
        "pip install -e examples/loongforge-example-device": NETWORK,
        "loongforge certify --family": "tests/certify/test_certify_family.py runs it",
        "loongforge certify": "a minute of training per call; tests/certify/test_certify.py and "
                              "tests/core/test_example_device.py run it",
    },
    "docs/diff.md": {
        "loongforge diff": "compares runs and checkpoints a user has (placeholders); tests/core/test_diff.py runs it",
    },
    "docs/cluster.md": {
        "torchrun --nnodes 2": CLUSTER,
        "loongforge launch k8s configs/my-run.yaml": SYNOPSIS,
        "kubectl apply": CLUSTER,
        "docker ": CLUSTER,
    },
    "docs/hf-interop.md": {
        "loongforge convert hf-to-mcore ./Qwen3-0.6B": WEIGHTS,
        "loongforge convert mcore-to-hf ./runs/run/checkpoints": SYNOPSIS,
        "loongforge generate ./runs/run/checkpoints": SYNOPSIS,
        "loongforge generate ./Qwen3-0.6B": WEIGHTS,
        "loongforge generate Qwen/Qwen3-0.6B": NETWORK_MODEL,
        "HF_HUB_OFFLINE=1 loongforge convert hf-to-mcore Qwen/Qwen3-0.6B": WEIGHTS,
    },
    "docs/parallelism.md": {
        "loongforge train run.yaml": SYNOPSIS,
        "torchrun --standalone --nproc-per-node 4 -m loongforge.cli train run.yaml": SYNOPSIS,
        "torchrun --nnodes 2": CLUSTER,
        "head=$(scontrol": CLUSTER,
        "srun torchrun": CLUSTER,
    },
    "docs/long-context.md": {
        "python benchmarks/cp_dynamic.py": SUITE,
        "python benchmarks/packed_attention.py": SUITE,
        "python benchmarks/moe_a2a_overlap.py": SUITE,
    },
    "docs/planner.md": {
        "loongforge plan CONFIG": SYNOPSIS,
        "python benchmarks/planner_calibration.py": SUITE,
    },
    "docs/reliability.md": {
        "head=$(scontrol": CLUSTER,
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE": CLUSTER,
        "srun torchrun": CLUSTER,
    },
    "docs/guide-llm.md": {
        "pip install": NETWORK,
        "tensorboard --logdir": SERVER,
    },
    "docs/guide-vlm.md": {
        "pip install": NETWORK,
        "loongforge convert hf-to-mcore Qwen2-VL-2B-Instruct": WEIGHTS,
        "loongforge convert mcore-to-hf ckpt/qwen2-vl-2b": WEIGHTS,
        "loongforge generate Qwen2-VL-2B-Instruct": WEIGHTS,
    },
    "docs/guide-diffusion.md": {
        "pip install": NETWORK,
        "loongforge cache-latents": WEIGHTS,
    },
    "docs/guide-embodied.md": {
        "pip install": NETWORK,
        "loongforge convert hf-to-mcore pi05_base": WEIGHTS,
        "loongforge convert mcore-to-hf ckpt/pi05-base.safetensors": WEIGHTS,
        "loongforge collect data/libero": LIBERO,
        "loongforge train configs/embodied-metaworld-reach.yaml run.name=libero-object0": LIBERO,
        "loongforge eval runs/libero-object0": LIBERO,
        "loongforge collect data/metaworld/reach-v3-2-corner32": "tests/core/test_shipped_configs.py runs this "
                                                                 "collect and a short run of the recipe on it",
        "loongforge train configs/embodied-wam-reach.yaml": "the world-action recipe: 17 minutes "
                                                            "(tests/core/test_shipped_configs.py trains it briefly)",
        "loongforge eval runs/embodied-wam-reach": "Meta-World closed loop with videos, 100 s to 13 minutes "
                                                   "(tests/embodied/test_policy_wam.py runs the evaluator with videos)",
    },
}

#: file -> {command as documented: words appended when the test runs it}: reference commands that train for
#: minutes as written (the guides' own commands are short as they stand).
CHEAP: dict[str, dict[str, str]] = {
    "docs/post-training.md": {
        "loongforge train configs/sft-tiny.yaml": "training.steps=4 training.sample_tokens=0",
        "loongforge train configs/dpo-tiny.yaml": "training.steps=4 evaluation.interval=4 evaluation.steps=1",
        "loongforge train configs/dpo-tiny.yaml model.lora.rank=8 run.output_dir=runs/dpo-tiny-lora":
            "training.steps=4 evaluation.interval=0",
        "loongforge train configs/grpo-tiny.yaml": "training.steps=2 evaluation.interval=0 grpo.group_size=2 "
                                                   "grpo.max_new_tokens=4 training.global_batch_size=2",
        "loongforge train configs/vlm-shapes.yaml": "training.steps=4",
        "loongforge train configs/vlm-dpo-shapes.yaml": "training.steps=4 evaluation.interval=4 evaluation.steps=1",
    },
    "docs/sft-lora.md": {
        "loongforge train configs/sft-tiny.yaml": "training.steps=4 training.sample_tokens=0",
        "loongforge train configs/sft-tiny.yaml model.lora.rank=8 run.output_dir=runs/sft-tiny-lora":
            "training.steps=4 training.sample_tokens=0",
    },
}

#: A bash/console block, also indented inside a list item (its lines then carry the fence's indentation).
_FENCE = re.compile(r"^([ \t]*)```(bash|console)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Command:
    text: str  # as documented, continuation lines joined (comments kept: bash drops them)
    #: What a console block records after the command (empty in a bash block).
    output: tuple[str, ...] = ()

    @property
    def words(self) -> list[str]:
        """The shell's words, comments dropped: what must agree across languages."""
        return shlex.split(self.text, comments=True)

    @property
    def key(self) -> str:
        """The command without its comments, words single-spaced: what :data:`EXCLUDED` and :data:`CHEAP` match."""
        return " ".join(self.words)


def _logical_lines(lines: list[str]) -> list[str]:
    joined: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    return joined


def blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, body)`` of every bash/console block of a Markdown file."""
    return [(language, textwrap.dedent(body) if indent else body)
            for indent, language, body in _FENCE.findall(path.read_text(encoding="utf-8"))]


def commands(path: Path) -> list[Command]:
    """The commands of a Markdown file's bash/console blocks, in document order (a console command with the
    output recorded after it)."""
    found = []
    for language, body in blocks(path):
        if language == "console":
            found += [Command(text, output) for text, output in _console_commands(body.splitlines())]
            continue
        for line in _logical_lines(body.splitlines()):
            if line.strip() and shlex.split(line, comments=True):
                found.append(Command(line.strip()))
    return found


def _console_commands(lines: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``(command, recorded output)`` of each ``$ `` line of a console block (continuation lines joined)."""
    found: list[tuple[str, list[str]]] = []
    continuing = False
    for line in lines:
        if line.startswith("$ ") or continuing:
            text = line[2:] if line.startswith("$ ") else line
            if continuing:
                found[-1] = (found[-1][0][:-1].rstrip() + " " + text.strip(), found[-1][1])
            else:
                found.append((text.strip(), []))
            continuing = line.rstrip().endswith("\\")
        elif found:
            found[-1][1].append(line)
    return [(text, tuple(output)) for text, output in found if shlex.split(text, comments=True)]


#: Recorded output that must come out again: each step's loss (and validation loss), a run's first and last loss,
#: sample scores and held-out numbers, the checkpoints saved, lm-eval's scores (task, metric, value). Speeds, ETAs and
#: memory vary from machine to machine.
_MUST_MATCH = (
    re.compile(r"^(step \d+/\d+) \| ((?:val_)?loss [-\d.]+)"),
    re.compile(r"^\[loongforge\] done: (\d+ steps, loss [-\d.]+ -> [-\d.]+)"),
    re.compile(r"^\[loongforge\] ((?:sample scores|held out action mse|validation): .*)$"),
    re.compile(r"^(saved checkpoint \S+)"),
    re.compile(r"^\|([\w ]*?)\s*\|[^|]*\|[^|]*\|[^|]*\|\s*(\w+)\s*\|[^|]*\|\s*([-\d.]+)\s*\|"),  # lm-eval's table
)


def must_match(lines: list[str] | tuple[str, ...]) -> list[str]:
    """The parts of ``lines`` that a rerun must reproduce (see :data:`_MUST_MATCH`)."""
    return [" ".join(match.groups()) for line in lines for pattern in _MUST_MATCH
            if (match := pattern.match(line.strip()))]


def english_docs() -> list[Path]:
    return [Path("README.md"), *sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))]


def chinese_counterpart(english: Path) -> Path:
    return ZH / ("README.md" if english == Path("README.md") else english.name)


def chinese_docs() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / ZH).glob("*.md"))


def exclusion(file: str, command: Command) -> str | None:
    return next((why for start, why in EXCLUDED.get(file, {}).items() if command.key.startswith(start)), None)


def test_extractor_reads_commands_not_output_or_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        ```bash
        # a comment line
        loongforge plugins   # trailing comment
        loongforge train a.yaml \\
            training.steps=2
        ```

        ```console
        $ loongforge doctor
        loongforge-core 0.4.0
        $ echo 'a # b'
        a # b
        ```

        ```python
        print('not a command')
        ```

        - item

          ```bash
          loongforge list models
          ```
        """), encoding="utf-8")
    assert [c.words for c in commands(page)] == [
        ["loongforge", "plugins"], ["loongforge", "train", "a.yaml", "training.steps=2"], ["loongforge", "doctor"],
        ["echo", "a # b"], ["loongforge", "list", "models"]]


def test_recorded_output_is_read_and_what_must_match_is_picked(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        ```console
        $ loongforge train a.yaml \\
            training.steps=2
        step 1/2 | loss 5.9000 | lr 0.000e+00 | grad_norm 1.0 | 300 tok/s | MFU 9.0% | eta 3s
        saved checkpoint runs/a/checkpoints/step-0000002
        [loongforge] done: 2 steps, loss 5.9000 -> 5.1000, 200 tokens/s
        [loongforge] memory (MiB): parameters 3.5, peak 900
        $ loongforge doctor
        $ loongforge eval ckpt --tasks t.yaml
        eval loglikelihood: 40/40 request (28.33/s, 1.4s)
        |  Tasks  |Version|Filter|n-shot| Metric |   |Value |   |Stderr|
        |---------|-------|------|-----:|--------|---|-----:|---|------|
        |cloze    |Yaml   |none  |     0|acc     |↑  |0.2500|±  |   N/A|
        |         |       |none  |     0|acc_norm|↑  |0.5000|±  |   N/A|
        ```
        """), encoding="utf-8")
    train, doctor, evaluate = commands(page)
    assert train.words == ["loongforge", "train", "a.yaml", "training.steps=2"] and doctor.output == ()
    assert must_match(train.output) == ["step 1/2 loss 5.9000", "saved checkpoint runs/a/checkpoints/step-0000002",
                                        "2 steps, loss 5.9000 -> 5.1000"]
    assert must_match(evaluate.output) == ["cloze acc 0.2500", " acc_norm 0.5000"]


def test_documented_commands_are_found():
    """The extractor sees the guides' commands (an empty list would make every other test vacuous)."""
    guide = commands(ROOT / "docs" / "guide-llm.md")
    assert any(c.key.startswith("loongforge train configs/quickstart.yaml") for c in guide)
    assert all(not c.text.startswith("$") for c in guide)
    assert {"docs/guide-llm.md", "docs/guide-vlm.md", "docs/guide-diffusion.md",
            "docs/guide-embodied.md"} <= {str(p) for p in english_docs()}


@pytest.mark.parametrize("chinese", chinese_docs(), ids=str)
def test_chinese_docs_show_the_english_commands(chinese):
    english = Path("README.md") if chinese.name == "README.md" else Path("docs") / chinese.name
    assert (ROOT / english).is_file(), f"{chinese} has no English counterpart {english}"
    assert [c.words for c in commands(ROOT / chinese)] == [c.words for c in commands(ROOT / english)]
    console = [body for language, body in blocks(ROOT / english) if language == "console"]
    assert [body for language, body in blocks(ROOT / chinese) if language == "console"] == console


def test_every_guide_and_the_readme_have_a_chinese_version():
    wanted = {chinese_counterpart(p) for p in english_docs() if p.name == "README.md" or p.name.startswith("guide-")}
    assert wanted <= set(chinese_docs())


def test_exclusions_and_rewrites_name_documented_commands():
    """No stale entries: each exclusion matches a command of its file, each rewrite is a command of its file."""
    for file, entries in EXCLUDED.items():
        keys = [c.key for c in commands(ROOT / file)]
        stale = [start for start in entries if not any(key.startswith(start) for key in keys)]
        assert not stale, f"EXCLUDED entries of {file} match no documented command: {stale}"
    for file, entries in CHEAP.items():
        keys = {c.key for c in commands(ROOT / file)}
        assert set(entries) <= keys, f"CHEAP entries of {file} are no documented command: {set(entries) - keys}"
        assert all(shlex.join(shlex.split(command)) == command for command in entries), "CHEAP: plain commands only"


#: A number in a recorded line (a loss, a perplexity, a score).
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
#: How far a recorded number may be from the printed one: the CPU's kernels (AVX2 or AVX-512, which ATen picks by
#: the processor) round differently, and after a few dozen steps a loss moves in its 4th or 5th significant digit;
#: anything a change of behaviour does moves it far more.
RECORDED_RTOL = 1e-3


def same_up_to_rounding(recorded: str, printed: str) -> bool:
    """The two lines are equal, or equal but for numbers within :data:`RECORDED_RTOL` of each other."""
    if recorded == printed:
        return True
    if NUMBER.split(recorded) != NUMBER.split(printed):
        return False
    pairs = zip(NUMBER.findall(recorded), NUMBER.findall(printed), strict=True)
    return all(abs(float(a) - float(b)) <= RECORDED_RTOL * max(abs(float(a)), 1e-3) for a, b in pairs)


def test_recorded_numbers_compare_up_to_rounding_only():
    assert same_up_to_rounding("20 steps, loss 5.8768 -> 1.4074", "20 steps, loss 5.8768 -> 1.4073")
    assert same_up_to_rounding(" word_perplexity 854963.3961", " word_perplexity 854965.3579")
    assert not same_up_to_rounding("20 steps, loss 5.8768 -> 1.4074", "20 steps, loss 5.8768 -> 1.4104")
    assert not same_up_to_rounding("20 steps, loss 5.8768 -> 1.4074", "20 steps, loss 5.8768 -> 1.4074 (nan)")
    assert not same_up_to_rounding("acc 0.2500", "acc 0.5000") and not same_up_to_rounding("2 steps", "3 steps")


def runnable(file: str) -> list[tuple[str, tuple[str, ...]]]:
    """The commands of one English file the test runs, as documented, with what their output must reproduce; a
    :data:`CHEAP` one (a plain command, no shell syntax) is rebuilt from its words with the overrides after them, so
    that they cannot land in a comment, and its recorded output (of the full command) is not compared."""
    cheap = CHEAP.get(file, {})
    return [(shlex.join([*c.words, *cheap[c.key].split()]), ()) if c.key in cheap
            else (c.text, tuple(must_match(c.output)))
            for c in commands(ROOT / file) if exclusion(file, c) is None]


@pytest.mark.slow
@pytest.mark.needs_plugins
@pytest.mark.parametrize("file", [str(p) for p in english_docs() if commands(ROOT / p)], ids=str)
def test_documented_commands_exit_0(file, tmp_path):
    for name in ("configs", "loongforge-core"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent  # the environment's loongforge, torchrun, ...
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "LOONGFORGE_PROGRESS": "plain"}
    for command, recorded in runnable(file):
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == 0, (f"{file}: `{command}` exited {result.returncode}\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        printed = must_match((result.stdout + result.stderr).splitlines())
        drifted = [line for line in recorded if not any(same_up_to_rounding(line, out) for out in printed)]
        assert not drifted, (f"{file}: `{command}` no longer prints what the guide records: {drifted[:3]}; "
                             f"it prints {printed[:6]}")
