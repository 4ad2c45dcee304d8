"""Ten SIGKILLs at pseudo-random moments, five kinds of them inside a checkpoint save, cost no step and no checkpoint.

One run of ``loongforge train configs/quickstart.yaml`` (a tiny model, 40 steps, a checkpoint every 4) is SIGKILLed
ten times, each time relaunched with the same command, which resumes from the newest checkpoint. The moments are
drawn from a fixed seed (every kind of moment at least once), always after the newest checkpoint so that each one
is reached:

* ``step`` -- at the end of a step, between two saves;
* ``hook`` -- inside a plugin's ``on_checkpoint_save`` (the lifecycle hook's place in the save);
* ``weights`` -- in the middle of writing the weights file (``model_optim/__0_0.distcp``), after some of its items
  are on disk;
* ``manifest`` -- after the manifest is written and fsynced, right before ``.tmp-step-N`` is renamed to ``step-N``;
* ``latest`` -- after that rename, before the ``latest`` pointer is replaced;
* ``prune`` -- while the pruner deletes an old checkpoint, after its first file is gone.

After every kill the test checks what a user would find: every visible ``step-N`` verifies against its manifest,
nothing is quarantined, ``latest`` names a visible checkpoint, the newest checkpoint is the one the moment implies
(a save killed before its rename is not visible, one killed after it is), and every metrics line on disk holds the
uninterrupted run's numbers. The relaunch must say it resumed from that newest checkpoint. At the end the
concatenated per-step losses (metrics.jsonl, each step once) equal an uninterrupted run's bit for bit.

Cheap by design: a driver process imports torch and megatron once and forks every launch; each forked child runs
the CLI's ``main`` with its fault armed and is the process that gets SIGKILLed. Nothing of a run exists before the
fork (the plugin host, megatron's parallel state and the process group are created in the child), so a relaunch
is a fresh run as far as training and checkpoints are concerned.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from loongforge.checkpoint.manifest import CheckpointCorruptError, verify_manifest

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
#: Every kill lands within the next save (``prune`` within the next three), and only ``latest`` and ``prune`` make
#: the save they hit visible, so ten kills stay below step 37: the last launch always has steps left to train.
STEPS, INTERVAL, KEEP = 40, 4, 2
#: The quickstart recipe at test size: a 2-layer d64 model, short sequences, no sample, a log line every 5 steps
#: (not a multiple of the checkpoint interval: a saved step's metrics must be on disk without a log line's flush).
OVERRIDES = [
    "model.overrides.num_layers=2", "model.overrides.hidden_size=64", "model.overrides.ffn_hidden_size=176",
    "data.seq_length=64", "training.micro_batch_size=2", f"training.steps={STEPS}", "training.threads=1",
    "training.sample_tokens=0", "scheduler.warmup_steps=4", "logging.interval=5", "logging.progress=false",
    "logging.tensorboard=false", "checkpoint.resume=auto",
]
KILLS, SEED = 10, 20240517
#: Where a kill lands: between saves (``step``) or at one of five moments inside a save.
MOMENTS = ("step", "hook", "weights", "manifest", "latest", "prune")
#: Moments after which the save being made is visible (after its rename).
VISIBLE_AFTER = ("latest", "prune")

#: FAULT INJECTION. A driver that imports the training stack once, then for each request on stdin (one JSON line:
#: the CLI arguments, a log file, an optional fault, a time limit) forks a child that arms the fault and runs
#: ``loongforge.cli.main``; it answers one JSON line with how the child ended. An armed child appends the moment to
#: ``kill_log`` (fsynced) just before it SIGKILLs itself, so the test knows the fault fired where it was planned.
DRIVER = textwrap.dedent(
    r'''
    import json, os, re, shutil, signal, sys
    from pathlib import Path

    import loongforge.cli
    import loongforge.train.run  # noqa: F401 -- torch, megatron and the trainer, imported once before any fork
    import torch.distributed.checkpoint.filesystem as dcp_files


    def arm(fault, kill_log):
        """Make this process SIGKILL itself at ``fault["moment"]`` of step ``fault["step"]``."""
        moment, step = fault["moment"], fault["step"]
        tmp_name, final_name = f".tmp-step-{step:07d}", f"step-{step:07d}"

        def fire():
            with open(kill_log, "a") as log:
                log.write(f"{moment}:{step}\n")
                log.flush()
                os.fsync(log.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        from loongforge import get_host, hookimpl

        class Faults:
            @hookimpl
            def loongforge_on_step_end(self, step):
                if moment == "step" and step == fault["step"]:
                    fire()

            @hookimpl
            def loongforge_on_checkpoint_save(self, trainer, path):
                if moment == "hook" and Path(path).name == tmp_name:
                    fire()

        get_host().register(Faults(), "faults")
        if moment == "weights":  # after fault["items"] items of this rank's data file are written and flushed
            write_item, written = dcp_files._write_item, []

            def counting_write_item(transforms, stream, *args, **kwargs):
                result = write_item(transforms, stream, *args, **kwargs)
                if tmp_name in Path(stream.name).parts:
                    written.append(result)
                    if len(written) == fault["items"]:
                        stream.flush()
                        fire()
                return result

            dcp_files._write_item = counting_write_item
        elif moment == "manifest":  # manifest written, everything fsynced: the rename that publishes it
            rename = os.rename

            def killing_rename(src, dst, *args, **kwargs):
                if Path(src).name == tmp_name and Path(dst).name == final_name:
                    fire()
                return rename(src, dst, *args, **kwargs)

            os.rename = killing_rename
        elif moment == "latest":  # step-N is visible; the pointer still names the previous checkpoint
            replace = os.replace

            def killing_replace(src, dst, *args, **kwargs):
                if Path(dst).name == "latest" and Path(src).read_text().strip() == final_name:
                    fire()
                return replace(src, dst, *args, **kwargs)

            os.replace = killing_replace
        elif moment == "prune":  # after committing step-N, while an older checkpoint is deleted
            rmtree = shutil.rmtree

            def killing_rmtree(path, *args, **kwargs):
                doomed = Path(path)  # an old step-M under whatever name the pruner deletes it; not a stale save
                pruned = re.search(r"step-\d{7,}$", doomed.name) and not doomed.name.startswith(".tmp-step-")
                if pruned and (doomed.parent / final_name).is_dir():
                    first = min(p for p in doomed.rglob("*") if p.is_file())
                    first.unlink()
                    fire()
                return rmtree(path, *args, **kwargs)

            shutil.rmtree = killing_rmtree


    def launch(request):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: one `loongforge train`, output to its own log
            status = 1
            try:
                signal.alarm(request["timeout"])  # a hung launch ends with SIGALRM instead of hanging the test
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                if request["fault"] is not None:
                    arm(request["fault"], request["kill_log"])
                status = loongforge.cli.main(request["args"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        return {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}


    for line in sys.stdin:
        print(json.dumps(launch(json.loads(line))), flush=True)
    '''
)


class Driver:
    """The driver subprocess: :meth:`train` runs one ``loongforge train`` launch in a fork of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kill_log = root / "kills.log"
        script = root / "driver.py"
        script.write_text(DRIVER)
        self.process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.launches = 0

    def train(self, out: Path, *overrides: str, fault: dict | None = None) -> tuple[dict, str]:
        """``loongforge train quickstart.yaml run.output_dir=OUT ...`` with ``fault`` armed; returns how the child
        ended (``{"exit": code}`` or ``{"signal": number}``) and its output."""
        self.launches += 1
        log = self.root / f"launch-{self.launches:02d}.log"
        args = ["train", str(QUICKSTART), f"run.output_dir={out}", *OVERRIDES, *overrides]
        request = {"args": args, "log": str(log), "fault": fault, "kill_log": str(self.kill_log), "timeout": 300}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the driver died: {log.read_text()[-3000:] if log.exists() else ''}"
        return json.loads(answer), log.read_text()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a torn last line (the kill landed mid-write) is left out, any other bad line fails."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    rows = []
    for index, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            assert index == len(lines) - 1, f"line {index + 1} of metrics.jsonl is not JSON: {line!r}"
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {row["step"]: row for row in rows}


def _visible(ckpts: Path) -> list[int]:
    """Steps of the visible checkpoints (``step-N`` directories), oldest first."""
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckpts.iterdir() if re.fullmatch(r"step-\d{7,}", p.name))


def _assert_nothing_corrupt(ckpts: Path, after: str) -> None:
    """Every visible checkpoint verifies in full, none was quarantined, ``latest`` names a visible one."""
    for step in _visible(ckpts):
        try:
            verify_manifest(ckpts / f"step-{step:07d}")
        except CheckpointCorruptError as exc:
            pytest.fail(f"after the kill {after}, a visible checkpoint is corrupt: {exc}")
    quarantined = [p.name for p in ckpts.iterdir() if ".corrupt" in p.name] if ckpts.is_dir() else []
    assert not quarantined, f"checkpoints were quarantined: {quarantined}"
    if (ckpts / "latest").exists():
        assert (ckpts / (ckpts / "latest").read_text().strip()).is_dir(), "latest names a missing checkpoint"


def _assert_resumed(log: str, ckpts: Path, newest: int) -> None:
    """The launch resumed from checkpoint ``newest`` (none when it is 0)."""
    if newest:
        assert f"resumed from {ckpts / f'step-{newest:07d}'} at step {newest}" in log, log[-3000:]
    else:
        assert "resumed from" not in log, log[-3000:]


def _draw(rng: random.Random, moment: str, newest: int, visible: list[int]) -> dict:
    """Where ``moment`` strikes: after ``newest`` (where the relaunch resumes), no later than the next save -- any
    step up to it for ``step``, that save for the others -- except ``prune``, which takes the first save whose
    commit deletes a checkpoint (keep_last older ones exist by then)."""
    saves_ahead = max(1, KEEP + 1 - len(visible)) if moment == "prune" else 1
    step = newest + INTERVAL * saves_ahead
    if moment == "step":
        step = rng.randint(newest + 1, step)
    assert step <= STEPS, f"no room left for {moment} after step {newest}"
    fault = {"moment": moment, "step": step}
    if moment == "weights":
        fault["items"] = rng.randint(1, 8)
    return fault


def _plan(rng: random.Random) -> list[str]:
    """Ten moments, each kind at least once, in a seeded order (taken from the end)."""
    moments = list(MOMENTS) + [rng.choice(MOMENTS) for _ in range(KILLS - len(MOMENTS))]
    rng.shuffle(moments)
    return moments


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    driver = Driver(tmp_path_factory.mktemp("sigkill"))
    yield driver
    driver.close()


def test_ten_sigkills_including_inside_saves_resume_bit_exactly(driver, tmp_path):
    ended, log = driver.train(tmp_path / "straight", "checkpoint.interval=0", "checkpoint.save_at_end=false")
    assert ended == {"exit": 0}, log[-3000:]
    reference = _metrics(tmp_path / "straight")
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS]["loss"] < reference[1]["loss"] - 0.5  # it learns: the comparison is not of constants

    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    run = [f"checkpoint.interval={INTERVAL}", f"checkpoint.keep_last={KEEP}"]
    rng = random.Random(SEED)
    moments = _plan(rng)
    fired: list[str] = []
    newest = 0
    while moments:
        fault = _draw(rng, moments.pop(), newest, _visible(ckpts))
        ended, log = driver.train(out, *run, fault=fault)
        assert ended == {"signal": signal.SIGKILL}, f"{fault} did not fire: {ended}\n{log[-3000:]}"
        fired.append(f"{fault['moment']}:{fault['step']}")
        assert driver.kill_log.read_text().splitlines() == fired
        _assert_resumed(log, ckpts, newest)
        _assert_nothing_corrupt(ckpts, after=fired[-1])
        unpublished = ckpts / f".tmp-step-{fault['step']:07d}"  # what a save killed before its rename leaves
        if fault["moment"] == "weights":
            assert [f for f in (unpublished / "model_optim").glob("*.distcp") if f.stat().st_size > 0]
        if fault["moment"] == "manifest":
            assert (unpublished / "manifest.json").is_file()
        # Only a save killed after its rename is visible; the kills land no later than the next save.
        expected = fault["step"] if fault["moment"] in VISIBLE_AFTER else newest
        newest = max(_visible(ckpts), default=0)
        assert newest == expected, f"after {fault}: the newest checkpoint is {newest}, expected {expected}"
        rows = _metrics(out)
        assert set(range(1, newest + 1)) <= set(rows), f"after {fault}: metrics of saved steps are missing"
        for step, row in rows.items():
            assert step <= fault["step"] and row["loss"] == reference[step]["loss"], (fault, step)

    assert {entry.split(":")[0] for entry in fired} == set(MOMENTS)
    ended, log = driver.train(out, *run)
    assert ended == {"exit": 0}, log[-3000:]
    _assert_resumed(log, ckpts, newest)
    _assert_nothing_corrupt(ckpts, after="the last relaunch")
    assert max(_visible(ckpts)) == STEPS
    rows = _metrics(out)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert rows[step][key] == reference[step][key], f"step {step} {key}: {rows[step][key]!r} != " \
                                                           f"{reference[step][key]!r}"
