"""The container recipes under ``containers/`` lint clean: they parse, and every ``pip install`` pin agrees with the
repository.

No image can be built here (no Docker engine, no registry), so this is what is checked instead of a build:

* the Dockerfile parses (dockerfile-parse) into known instructions, starts with the BuildKit syntax directive its
  ``RUN --mount`` needs, and its base image has an explicit tag;
* every requirement a ``pip install`` names is pinned with ``==``; a LoongForge package at its pyproject version
  with extras it declares; every dependency the installed LoongForge packages declare (with those extras, and the
  build backend the wheels are built with) is pinned in the same file -- except what the base image provides -- and
  the pin is inside the declared range; the CUDA image's torch is the torch the test suite runs (noxfile.py);
* installs after torch run under ``PIP_CONSTRAINT`` (which freezes the image's torch), and the image never
  pip-installs a torch the base provides (Kunlun's XPyTorch);
* what ``RUN --mount`` binds from the build context exists and is let through the Dockerfile's own ignore file.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ROOT / "containers"
#: Dockerfile -> packages its base image (not pip) provides, which the file must therefore never pip-install.
PROVIDED_BY_BASE = {"cuda.Dockerfile": set(), "kunlun.Dockerfile": {"torch"}}
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "CMD", "ENTRYPOINT", "LABEL", "USER",
                "EXPOSE", "VOLUME", "SHELL", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD",
                "COMMENT"}  # dockerfile-parse reports comments (and the syntax directive) as COMMENT
#: pip options these recipes may use (``-r``/``-c`` files or ``-e`` would hide what is installed from this lint).
PIP_FLAGS = {"--no-build-isolation", "--no-index", "--no-deps"}
PIP_OPTIONS_WITH_VALUE = {"--find-links", "--wheel-dir"}
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>", "<", "(", ")"}


@dataclass(frozen=True)
class Project:
    name: str
    version: Version
    dependencies: tuple[Requirement, ...]
    extras: dict[str, tuple[Requirement, ...]]
    build_requires: tuple[Requirement, ...]


def repo_projects() -> dict[str, Project]:
    projects = {}
    for path in [ROOT / "loongforge-core" / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        data = tomllib.loads(path.read_text())
        project = data["project"]
        projects[canonicalize_name(project["name"])] = Project(
            name=project["name"], version=Version(project["version"]),
            dependencies=tuple(map(Requirement, project.get("dependencies", []))),
            extras={extra: tuple(map(Requirement, reqs)) for extra, reqs in
                    project.get("optional-dependencies", {}).items()},
            build_requires=tuple(map(Requirement, data["build-system"]["requires"])))
    return projects


PROJECTS = repo_projects()


def pip_installs(run: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in a RUN command (``pip``, ``pip3`` or ``python[3] -m pip``)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    installs = []
    for words in commands:
        while words and ("=" in words[0] and not words[0].startswith("-")):  # VAR=value before the command
            words = words[1:]
        if words[:2] in (["pip", "install"], ["pip3", "install"]):
            installs.append(words[2:])
        elif len(words) >= 4 and words[0] in ("python", "python3") and words[1:4] == ["-m", "pip", "install"]:
            installs.append(words[4:])
    return installs


@dataclass(frozen=True)
class Recipe:
    path: Path
    parser: DockerfileParser
    pins: dict[str, tuple[Requirement, int]]  #: package -> (its pin, line of the RUN installing it)
    torch_line: int | None  #: line of the RUN that pip-installs torch
    constraint_line: int | None  #: line of ENV PIP_CONSTRAINT


def read(path: Path) -> Recipe:
    parser = DockerfileParser(path=str(path))
    pins: dict[str, tuple[Requirement, int]] = {}
    constraint_line = torch_line = None
    for instruction in parser.structure:
        line = instruction["startline"] + 1
        if instruction["instruction"] == "ENV" and "PIP_CONSTRAINT=" in instruction["value"]:
            constraint_line = line
        if instruction["instruction"] != "RUN":
            continue
        for arguments in pip_installs(instruction["value"]):
            for requirement in _requirements(arguments, path, line):
                name = canonicalize_name(requirement.name)
                assert name not in pins or str(pins[name][0]) == str(requirement), \
                    f"{path.name}:{line}: {requirement} and {pins[name][0]} (line {pins[name][1]}) disagree"
                pins[name] = (requirement, line)
                if name == "torch":
                    torch_line = line
    return Recipe(path, parser, pins, torch_line, constraint_line)


def _requirements(arguments: list[str], path: Path, line: int) -> list[Requirement]:
    found, skip_value = [], False
    for argument in arguments:
        if skip_value:
            skip_value = False
            continue
        if argument.startswith("-"):
            option = argument.split("=", 1)[0]
            assert option in PIP_FLAGS | PIP_OPTIONS_WITH_VALUE, f"{path.name}:{line}: pip option {argument}"
            skip_value = option in PIP_OPTIONS_WITH_VALUE and "=" not in argument
            continue
        requirement = Requirement(argument)
        specifiers = list(requirement.specifier)
        assert requirement.url is None and requirement.marker is None, f"{path.name}:{line}: {argument}"
        assert len(specifiers) == 1 and specifiers[0].operator == "==", f"{path.name}:{line}: {argument} not pinned"
        found.append(requirement)
    assert found, f"{path.name}:{line}: pip install of nothing"
    return found


def lint_syntax(path: Path) -> None:
    """Known instructions, the BuildKit syntax directive first, a tagged base, a CMD last."""
    recipe = read(path)
    structure = recipe.parser.structure
    first = structure[0]
    assert (first["instruction"], first["startline"], first["value"]) == \
        ("COMMENT", 0, "syntax=docker/dockerfile:1.7"), f"{path.name}: BuildKit syntax directive (RUN --mount)"
    unknown = [(i["startline"] + 1, i["instruction"]) for i in structure if i["instruction"] not in INSTRUCTIONS]
    assert not unknown, f"{path.name}: unknown instructions (a missing line continuation?): {unknown}"
    (base,) = recipe.parser.parent_images
    repository, _, tag = base.rpartition(":")
    assert repository and "/" not in tag and tag not in ("", "latest"), f"{path.name}: base {base!r} needs a tag"
    assert [i["instruction"] for i in structure if i["instruction"] != "COMMENT"][-1] == "CMD"


def lint_pins(path: Path) -> None:
    """Every pin against the pyproject files: versions, extras, declared ranges, nothing declared left unpinned."""
    recipe = read(path)
    provided = PROVIDED_BY_BASE[path.name]
    installed: list[tuple[Project, set[str]]] = []
    for name, (requirement, line) in recipe.pins.items():
        if name in PROJECTS:
            project = PROJECTS[name]
            assert str(requirement.specifier) == f"=={project.version}", \
                f"{path.name}:{line}: {requirement}, but {project.name} is {project.version} in its pyproject.toml"
            assert requirement.extras <= set(project.extras), f"{path.name}:{line}: {requirement}: unknown extra"
            installed.append((project, set(requirement.extras)))
    assert {canonicalize_name(p.name) for p, _ in installed} >= {"loongforge-core"}

    declared = [req for project, extras in installed
                for req in (*project.dependencies, *project.build_requires,
                            *(req for extra in sorted(extras) for req in project.extras[extra]))]
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        if name in provided:
            assert name not in recipe.pins, f"{path.name}: pip-installs {name}, which the base image provides"
            continue
        assert name in recipe.pins, f"{path.name}: {requirement} is declared by an installed package but not pinned"
        pinned = Version(next(iter(recipe.pins[name][0].specifier)).version)
        assert requirement.specifier.contains(pinned, prereleases=True), \
            f"{path.name}:{recipe.pins[name][1]}: {name}=={pinned} is outside the declared {requirement}"
        for extra in requirement.extras:  # e.g. transformer-engine[pytorch] must be installed with that extra
            assert extra in recipe.pins[name][0].extras, f"{path.name}: {name} without its declared extra [{extra}]"


def lint_torch_kept(path: Path) -> None:
    """Whatever is installed after torch runs under the constraint that freezes it."""
    recipe = read(path)
    assert recipe.constraint_line is not None, f"{path.name}: no ENV PIP_CONSTRAINT"
    assert recipe.torch_line is None or recipe.torch_line < recipe.constraint_line
    for requirement, line in recipe.pins.values():
        if line != recipe.torch_line:  # what torch is installed with is installed beside it, before the constraint
            assert line > recipe.constraint_line, \
                f"{path.name}:{line}: {requirement} is installed before the torch constraint is in place"


def lint_context(path: Path) -> None:
    """What ``RUN --mount`` binds from the build context is a package here, let through the ignore file."""
    recipe = read(path)
    ignore = (path.parent / f"{path.name}.dockerignore").read_text().split("\n")
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "the context is closed by default (the repository holds virtual environments)"
    sources = []
    for instruction in recipe.parser.structure:
        if instruction["instruction"] == "RUN":
            for token in shlex.split(instruction["value"]):
                if token.startswith("--mount="):
                    options = dict(item.partition("=")[::2] for item in token[len("--mount="):].split(","))
                    if options.get("type") == "bind" and "from" not in options:
                        sources.append(options["source"])
    assert sources, f"{path.name}: installs nothing from this checkout"
    for source in sources:
        assert (ROOT / source / "pyproject.toml").is_file(), f"{path.name}: binds {source}, not a package here"
        assert f"!{source}" in patterns, f"{path.name}.dockerignore leaves {source} out of the build context"


LINTS = (lint_syntax, lint_pins, lint_torch_kept, lint_context)
RECIPES = sorted(CONTAINERS.glob("*.Dockerfile"))


def test_both_recipes_exist():
    assert [path.name for path in RECIPES] == sorted(PROVIDED_BY_BASE)


@pytest.mark.parametrize("lint", LINTS, ids=lambda lint: lint.__name__)
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_the_recipes_lint_clean(path, lint):
    lint(path)


def test_the_cuda_image_runs_the_torch_the_suite_tests():
    noxfile = ast.parse((ROOT / "noxfile.py").read_text())
    (suite_torch,) = [ast.literal_eval(node.value) for node in noxfile.body if isinstance(node, ast.Assign)
                      and [getattr(t, "id", None) for t in node.targets] == ["TORCH"]]
    assert str(read(CONTAINERS / "cuda.Dockerfile").pins["torch"][0]) == suite_torch


_CORE = PROJECTS["loongforge-core"].version
_CUDA = PROJECTS["loongforge-cuda"].version
#: (recipe, text replaced, replacement, what the lint must say): each a mistake the lint exists to catch.
MISTAKES = [
    ("cuda.Dockerfile", f'"loongforge-core[hf]=={_CORE}"', f'"loongforge-core[hf]=={_CORE}.post1"',
     f"is {_CORE} in its pyproject"),
    ("cuda.Dockerfile", f'"loongforge-cuda[te,flash]=={_CUDA}"', f'"loongforge-cuda[te,fp4]=={_CUDA}"',
     "unknown extra"),
    ("cuda.Dockerfile", "flash-attn==2.8.3.post2", "flash-attn==2.5.9", "outside the declared flash-attn>=2.6"),
    ("cuda.Dockerfile", "numpy==2.4.6", "numpy==1.23.5", "outside the declared numpy>=1.24"),
    ("cuda.Dockerfile", " tokenizers==0.23.3", "", "tokenizers>=0.15 is declared by an installed package"),
    ("cuda.Dockerfile", '"transformer-engine[pytorch,core-cu13]==2.20.2"', '"transformer-engine[core-cu13]==2.20.2"',
     "without its declared extra [pytorch]"),
    ("cuda.Dockerfile", "rich==15.0.0", "rich>=15", "not pinned"),
    ("cuda.Dockerfile", "pip install megatron-core", "pip install -r requirements.txt megatron-core", "pip option -r"),
    ("cuda.Dockerfile", "ubuntu24.04\n", "ubuntu24.04\nARG LATEST=nvidia/cuda:latest\n", None),  # control: unused
    ("cuda.Dockerfile", "nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04", "nvidia/cuda", "needs a tag"),
    ("cuda.Dockerfile", "python3-venv git \\\n", "python3-venv git\n", "unknown instructions"),
    ("cuda.Dockerfile", "ENV PIP_CONSTRAINT=/opt/loongforge/constraints.txt\n", "", "no ENV PIP_CONSTRAINT"),
    ("kunlun.Dockerfile", "pip install megatron-core", "pip install torch==2.5.1 megatron-core",
     "pip-installs torch, which the base image provides"),
    ("kunlun.Dockerfile", "source=plugins/loongforge-xpu,", "source=plugins/loongforge-npu,", "not a package here"),
]


@pytest.mark.parametrize(("recipe", "old", "new", "message"), MISTAKES, ids=[m[3] or "control" for m in MISTAKES])
def test_the_lint_catches_each_mistake(tmp_path, recipe, old, new, message):
    """The controls: each mistake, made in a copy of a recipe, fails the lint with its own message (and a harmless
    change passes, so the lint is not failing on anything at all)."""
    source = CONTAINERS / recipe
    text = source.read_text()
    assert text.count(old) == 1, old
    copy = tmp_path / recipe
    copy.write_text(text.replace(old, new))
    (tmp_path / f"{recipe}.dockerignore").write_text((CONTAINERS / f"{recipe}.dockerignore").read_text())
    if message is None:
        for lint in LINTS:
            lint(copy)
        return
    with pytest.raises(AssertionError, match=re.escape(message)):
        for lint in LINTS:
            lint(copy)


def test_the_lint_catches_a_context_that_leaves_the_plugin_out(tmp_path):
    for name in ("cuda.Dockerfile", "cuda.Dockerfile.dockerignore"):
        (tmp_path / name).write_text((CONTAINERS / name).read_text().replace("!plugins/loongforge-cuda\n", ""))
    with pytest.raises(AssertionError, match="leaves plugins/loongforge-cuda out of the build context"):
        lint_context(tmp_path / "cuda.Dockerfile")
