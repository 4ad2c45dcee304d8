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
#: Plugin extras the tests need: reference implementations (diffusion's ``test``), the Meta-World simulator and
#: the policy server's websocket/msgpack stack and the RLDS reader's protobuf (embodied's ``sim``, ``serve``, ``rlds``),
#: Megatron-Energon, whose own tools write the datasets the VLM ``energon`` kind reads (vlm's ``energon``).
TEST_EXTRAS = {"diffusion": "[test]", "embodied": "[sim,serve,rlds]", "vlm": "[energon]"}


#: Core's optional trackers and ``loongforge plot``, which tests/core/test_trackers.py and test_plot.py run for real.
TRACKER_EXTRAS = ("wandb", "mlflow", "plot")


def _install_core(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f"loongforge-core[{','.join(extras)}]" if extras else "loongforge-core"
    session.install("-e", spec)


#: First-party plugins a plugin depends on (installed from this checkout first: they are not on a package index).
PLUGIN_DEPENDS = {"embodied": ("vlm", "diffusion")}


def _install_plugins(session: nox.Session, *names: str) -> None:
    for name in names:
        for needed in PLUGIN_DEPENDS.get(name, ()):
            session.install("-e", f"plugins/loongforge-{needed}")
        session.install("-e", f"plugins/loongforge-{name}{TEST_EXTRAS.get(name, '')}")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite: core and every first-party plugin installed together."""
    _install_core(session, "test", "hf", "eval", *TRACKER_EXTRAS)
    _install_plugins(session, *PLUGINS)
    # tests/slurm's jobs need the Slurm daemons that only ``nox -s slurm`` starts. Two pytest-xdist workers, each
    # taking whole files (module fixtures are shared within a file): much of the suite is one busy core at a time
    # (process start-up, imports, small models), so two files side by side fill both cores of a 2-core machine.
    # ``nox -s tests -- -n 4`` on a larger one (a later -n wins), ``-n 0`` for one process.
    # Tests that pip-install into this environment run apart, afterwards: a package half-installed beside a running
    # test would be discovered by its plugin loading.
    # One intra-op thread per test process: the two workers already fill the two cores, and a second OpenMP thread
    # each only oversubscribes them (spinning waits); the tests' torchrun launches set the same (parallel/launch.py).
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    session.run("pytest", "-q", "-ra", "--durations=15", "-n", "2", "--dist", "loadfile", "tests",
                "-m", "not slurm and not venv_install", *session.posargs, env=env)
    session.run("pytest", "-q", "-ra", "tests", "-m", "venv_install", *session.posargs, env=env)


@nox.session(python=PYTHON)
def slurm(session: nox.Session) -> None:
    """``loongforge launch slurm`` scripts under a real Slurm: tests/slurm/cluster.sh installs Debian's slurm-wlm and
    munge (apt, as root) and starts a one-node cluster on localhost; every daemon it started is stopped again, also
    when a test fails."""
    _install_core(session, "test")
    cluster = "tests/slurm/cluster.sh"
    env = {"SLURM_CONF": "/tmp/loongforge-slurm/slurm.conf"}  # the cluster script's state directory
    try:
        session.run("bash", cluster, "start", external=True)
        session.run("pytest", "-q", "-ra", "--durations=10", "tests/slurm", *session.posargs, env=env)
    finally:
        session.run("bash", cluster, "stop", external=True)


@nox.session(python=PYTHON)
def tests_core(session: nox.Session) -> None:
    """Core alone, no plugins installed: proves core never needs one."""
    _install_core(session, "test", "hf", "eval", *TRACKER_EXTRAS)
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


#: LeRobot 0.4.4's Pi0.5 and what it needs, without lerobot's own pins (its torch<2.11 cap and extras): its
#: ``lerobot.datasets`` imports torchvision, and PyPI's torchvision 0.29.1 only imports beside torch 2.14.1.
#: protobuf: our RLDS reader (embodied's ``rlds`` extra), whose conversion LeRobot's reader reads back.
LEROBOT_PARITY = ("torch==2.14.1", "torchvision==0.29.1", "transformers>=4.57.1,<5", "huggingface-hub>=0.34.2,<0.36",
                  "datasets>=4.0,<5", "draccus==0.10.0", "einops>=0.8,<0.9", "diffusers<0.36", "pyserial", "deepdiff",
                  "termcolor", "jsonlines", "accelerate", "imageio", "av>=17", "pillow", "pluggy", "pyyaml",
                  "safetensors", "numpy", "importlib-metadata", "pytest", "protobuf>=4.21")


def _install_lerobot(session: nox.Session, *extra: str) -> None:
    """The lerobot_parity environment (its pins, lerobot --no-deps, our packages --no-deps) plus ``extra``."""
    session.install(*LEROBOT_PARITY, *extra)
    session.install("--no-deps", "lerobot==0.4.4")
    session.install("--no-deps", "-e", "loongforge-core", "-e", "plugins/loongforge-vlm",
                    "-e", "plugins/loongforge-embodied")


@nox.session(python=PYTHON)
def lerobot_parity(session: nox.Session) -> None:
    """Pi0.5 parity with LeRobot 0.4.4's PI05Pytorch, and RLDS sets converted to LeRobot v3.0 read by LeRobot's own
    LeRobotDataset (parity/lerobot/README.md): its own venv, because LeRobot needs transformers 4.x and the main suite
    runs transformers 5."""
    _install_lerobot(session)
    session.run("pytest", "-q", "-s", "parity/lerobot", *session.posargs)


@nox.session(python=PYTHON)
def bench_lerobot(session: nox.Session) -> None:
    """Training samples/s of our Pi0.5 loop vs LeRobot 0.4.4's ``lerobot-train`` loop, alternated in one process
    (benchmarks/embodied_vs_lerobot.py; ``-- --steps 20 --rounds 3``). ``lerobot.policies.factory`` imports
    ``lerobot.envs``, hence gymnasium beside the parity pins."""
    _install_lerobot(session, "gymnasium>=1.1.1,<2")
    session.run("python", "benchmarks/embodied_vs_lerobot.py", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Side-by-side benchmark: LoongForge vs plain PyTorch (eager, compiled) and Hugging Face's Trainer on the same
    tiny Llama (the ``bench`` extra brings transformers and accelerate for the Trainer side)."""
    _install_core(session, "bench")
    session.run("python", "benchmarks/llm_pretrain.py", *session.posargs)


@nox.session(python=PYTHON)
def quickstart(session: nox.Session) -> None:
    """The README's quickstart: a tiny Llama on the shipped corpus."""
    _install_core(session)
    _install_plugins(session, *PLUGINS)
    session.run("loongforge", "train", "configs/quickstart.yaml", *session.posargs)
