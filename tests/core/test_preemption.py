"""Preemption and writable directories (issue 17, item 8).

SIGTERM or SIGUSR1 during training saves a checkpoint at the step boundary after the signal and exits with status
3 and one line; the same command then resumes and reproduces an uninterrupted run's losses bit for bit. With two
processes the ranks agree (only rank 1 is signalled, both save that step), and ``--nproc``'s launcher passes a
signal sent to it on to the ranks. An unwritable output or checkpoint directory is a one-line error before step 1,
from ``check`` as from ``train``.

The signals come from inside the real model's forward, sent by a plugin (``signaller``) that the subprocesses
discover as an installed distribution (a ``.dist-info`` with an entry point on ``PYTHONPATH``), so every rank of a
``--nproc`` launch has it, as a user's plugin would be.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from example_packages import plugin_site
from loongforge import hookimpl
from loongforge.checkpoint.manifest import verify_manifest
from loongforge.cli import main

CONFIG = """
run: {output_dir: OUT, seed: 7}
model: {name: llama-debug}
data: {seq_length: 64}
optimizer: {lr: 0.001}
scheduler: {warmup_steps: 3}
training: {steps: 8, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {interval: 0, keep_last: 3}
logging: {interval: 1, progress: false, tensorboard: false}
"""

#: FAULT INJECTION: the ``signaller`` plugin. When SIGNAL_AT names a forward (counted from 1) and this is rank
#: SIGNAL_RANK (default 0), that forward of the model sends SIGNAL_NAME to this process, or with
#: SIGNAL_TARGET=launcher to its parent (the ``--nproc`` launcher); SIGNAL_AT=build sends it while the model is
#: being built, before any step. Inert without SIGNAL_AT.
SIGNALLER = textwrap.dedent(
    '''
    import os
    import signal

    from loongforge import hookimpl

    forwards = 0


    def _send(module, args):
        global forwards
        forwards += 1
        if forwards == int(os.environ["SIGNAL_AT"]):
            target = os.getppid() if os.environ.get("SIGNAL_TARGET") == "launcher" else os.getpid()
            os.kill(target, getattr(signal, os.environ["SIGNAL_NAME"]))


    @hookimpl
    def loongforge_modify_model(model):
        if "SIGNAL_AT" in os.environ and os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0"):
            if os.environ["SIGNAL_AT"] == "build":
                os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL_NAME"]))
            else:
                model[0].register_forward_pre_hook(_send)
    '''
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding the ``signaller`` plugin as an installed distribution (for ``PYTHONPATH``)."""
    return plugin_site(tmp_path_factory.mktemp("site"), "signaller", SIGNALLER)


def _config(tmp_path: Path, name: str) -> tuple[Path, Path]:
    out = tmp_path / name
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(out)))
    return cfg, out


def _train(cfg: Path, site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``loongforge train CFG ARGS`` in a fresh process, the signaller installed; ``env`` configures it."""
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(cfg), *args],
                          env={**os.environ, "PYTHONPATH": python_path, **env}, capture_output=True, text=True,
                          timeout=300)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def _saved(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))


def _preempted_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "preempted" in line]


@pytest.mark.slow
def test_sigterm_saves_the_next_step_and_resume_is_bit_exact(tmp_path, site):
    cfg, out = _config(tmp_path, "straight")
    done = _train(cfg, site, "checkpoint.save_at_end=false")
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _losses(out)

    cfg, out = _config(tmp_path, "preempted")
    # Two micro-batches per step: forward 7 is step 4's first, so the signal lands in the middle of step 4.
    stopped = _train(cfg, site, SIGNAL_AT="7", SIGNAL_NAME="SIGTERM")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    newest = out / "checkpoints" / "step-0000004"
    assert _preempted_lines(stopped.stderr) == [f"[loongforge] preempted by SIGTERM at step 4 of 8: saved {newest}; "
                                                "the same command resumes from it"]
    assert "Traceback" not in stopped.stderr and "done:" not in stopped.stdout
    assert _saved(out) == ["step-0000004"] and sorted(_losses(out)) == [1, 2, 3, 4]

    resumed = _train(cfg, site)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest} at step 4" in resumed.stdout
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 9))
    for step in range(1, 9):
        assert losses[step] == reference[step], f"step {step}: {losses[step]!r} != {reference[step]!r}"


@pytest.mark.slow
@pytest.mark.distributed
def test_one_signalled_rank_makes_every_rank_save_that_step(tmp_path, site):
    cfg, out = _config(tmp_path, "ranks")
    # One micro-batch per rank and step: rank 1 alone gets the signal, during step 3's forward.
    stopped = _train(cfg, site, "--nproc", "2", SIGNAL_AT="3", SIGNAL_RANK="1", SIGNAL_NAME="SIGTERM")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    newest = out / "checkpoints" / "step-0000003"
    assert _preempted_lines(stopped.stderr) == [f"[loongforge] preempted by SIGTERM at step 3 of 8: saved {newest}; "
                                                "the same command resumes from it"]
    assert "Traceback" not in stopped.stderr
    assert _saved(out) == ["step-0000003"] and sorted(_losses(out)) == [1, 2, 3]
    assert verify_manifest(newest)["step"] == 3  # complete: both ranks wrote their part of step 3
    assert len(list((newest / "model_optim").glob("*.distcp"))) == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_the_nproc_launcher_passes_sigusr1_on_to_the_ranks(tmp_path, site):
    cfg, out = _config(tmp_path, "launcher")
    stopped = _train(cfg, site, "--nproc", "2", SIGNAL_AT="2", SIGNAL_RANK="1", SIGNAL_TARGET="launcher",
                     SIGNAL_NAME="SIGUSR1")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    (line,) = _preempted_lines(stopped.stderr)
    # The launcher forwards the signal after rank 1's step-2 forward; the ranks stop at the boundary they next
    # reach together.
    match = re.fullmatch(rf"\[loongforge\] preempted by SIGUSR1 at step (\d) of 8: saved "
                         rf"{re.escape(str(out))}/checkpoints/step-000000(\d); the same command resumes from it", line)
    assert match and match[1] == match[2] and int(match[1]) >= 2, line
    assert _saved(out) == [f"step-000000{match[1]}"]
    assert sorted(_losses(out)) == list(range(1, int(match[1]) + 1))


# -- in this process: cheap checks of the handlers and the directories --------------------------------------------

QUICKSTART = "configs/quickstart.yaml"
TINY_LLM = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
            "training.threads=1", "logging.progress=false", "logging.tensorboard=false", "training.sample_tokens=0",
            "training.steps=6", "checkpoint.interval=0"]


class SelfSignal:
    """Sends ``signum`` to this process at the end of step ``at``; records the SIGTERM handler seen during training."""

    def __init__(self, signum: int | None, at: int = 2) -> None:
        self.signum, self.at, self.handler_in_training = signum, at, None

    @hookimpl
    def loongforge_on_step_end(self, step):
        self.handler_in_training = signal.getsignal(signal.SIGTERM)
        if step == self.at and self.signum is not None:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def _repo_root(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])


@pytest.mark.usefixtures("_repo_root")
def test_the_handlers_exist_only_while_training(tmp_path, capsys, register_plugin):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    plugin = register_plugin(SelfSignal(signal.SIGUSR1), "self-signal")
    code = main(["train", QUICKSTART, *TINY_LLM, f"run.output_dir={tmp_path / 'run'}"])
    assert code == 3
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"[loongforge] preempted by SIGUSR1 at step 2 of 6: saved {tmp_path}/run/checkpoints/step-0000002; the same "
        "command resumes from it")
    assert plugin.handler_in_training not in (before[signal.SIGTERM], signal.SIG_DFL)
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the previous handlers are back


@pytest.mark.usefixtures("_repo_root")
def test_save_on_signal_false_installs_nothing(tmp_path, capsys, register_plugin):
    before = signal.getsignal(signal.SIGTERM)
    plugin = register_plugin(SelfSignal(None), "self-signal")
    code = main(["train", QUICKSTART, *TINY_LLM, "checkpoint.save_on_signal=false", f"run.output_dir={tmp_path}"])
    assert code == 0, capsys.readouterr().err
    assert plugin.handler_in_training is before


def _blocked_directory(tmp_path: Path) -> tuple[Path, str]:
    """A directory path this process cannot write, and the reason the OS gives: under a read-only directory, or
    (for root, whom permission bits do not stop) under a regular file."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked / "sub", "Permission denied"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "sub", "Not a directory"


@pytest.mark.usefixtures("_repo_root")
@pytest.mark.parametrize("command", ["train", "check"])
def test_an_unwritable_checkpoint_dir_fails_before_step_1(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = tmp_path / "run"
    code = main([command, QUICKSTART, *TINY_LLM, f"run.output_dir={out}", f"checkpoint.dir={blocker}/ckpt"])
    stdout, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [f"error: {QUICKSTART}: checkpoint.dir names {blocker}/ckpt, which is not writable "
                                "(Not a directory)"]
    assert "model:" not in stdout and not (out / "metrics.jsonl").exists()  # nothing was built or trained


@pytest.mark.usefixtures("_repo_root")
@pytest.mark.parametrize("command", ["train", "check"])
def test_an_unwritable_output_dir_fails_before_step_1(tmp_path, capsys, command):
    out, reason = _blocked_directory(tmp_path)
    try:
        code = main([command, QUICKSTART, *TINY_LLM, f"run.output_dir={out}"])
    finally:
        out.parent.chmod(0o700)
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {QUICKSTART}: run.output_dir names {out}, which is not writable ({reason})"]
    assert not out.exists()


def test_a_signal_during_start_up_is_answered_at_the_first_step_boundary(tmp_path, site):
    # Slurm's warning can come while the model is still being built (a lead too close to the time limit): the
    # rank must not die of it (a crash, requeued forever) but save after step 1 and exit 3 like any preemption.
    cfg, out = _config(tmp_path, "early")
    stopped = _train(cfg, site, SIGNAL_AT="build", SIGNAL_NAME="SIGUSR1")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    newest = out / "checkpoints" / "step-0000001"
    assert _preempted_lines(stopped.stderr) == [f"[loongforge] preempted by SIGUSR1 at step 1 of 8: saved {newest}; "
                                                "the same command resumes from it"]
    assert _saved(out) == ["step-0000001"] and sorted(_losses(out)) == [1]
