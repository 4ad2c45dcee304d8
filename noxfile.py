"""Developer and CI sessions.

``nox -s tests`` is the test command CI runs (see README.md). Each session installs the CPU build of torch
first (pinned, so pip never pulls a multi-GB CUDA build as a dependency), then core and plugins editable.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"
PLUGINS = ("cuda", "xpu", "vlm", "diffusion", "embodied", "balance")
#: Plugins whose tests need reference implementations (installed through the plugin's own ``test`` extra).
TEST_EXTRAS = {"diffusion": "[test]"}


def _install_core(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f"loongforge-core[{','.join(extras)}]" if extras else "loongforge-core"
    session.install("-e", spec)


def _install_plugins(session: nox.Session, *names: str) -> None:
    for name in names:
        session.install("-e", f"plugins/loongforge-{name}{TEST_EXTRAS.get(name, '')}")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite: core and every first-party plugin installed together."""
    _install_core(session, "test", "hf")
    _install_plugins(session, *PLUGINS)
    session.run("pytest", "-q", "-ra", "--durations=15", "tests", *session.posargs)


@nox.session(python=PYTHON)
def tests_core(session: nox.Session) -> None:
    """Core alone, no plugins installed: proves core never needs one."""
    _install_core(session, "test", "hf")
    session.run("pytest", "-q", "tests/core", "-m", "not needs_plugins", *session.posargs)


@nox.session(python=PYTHON)
@nox.parametrize("plugin", PLUGINS)
def tests_plugin(session: nox.Session, plugin: str) -> None:
    """Core plus one plugin: it imports, is discovered, and its own tests pass."""
    _install_core(session, "test", "hf")
    _install_plugins(session, plugin)
    session.run("python", "-c", f"import loongforge_{plugin}")
    session.run("loongforge", "plugins")
    session.run("pytest", "-q", f"tests/{plugin}", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Side-by-side benchmark: LoongForge vs a plain PyTorch loop on the same tiny Llama."""
    _install_core(session)
    session.run("python", "benchmarks/llm_pretrain.py", *session.posargs)


@nox.session(python=PYTHON)
def quickstart(session: nox.Session) -> None:
    """The README's quickstart: a tiny Llama on the shipped corpus."""
    _install_core(session)
    _install_plugins(session, *PLUGINS)
    session.run("loongforge", "train", "configs/quickstart.yaml", *session.posargs)
