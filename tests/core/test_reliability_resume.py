"""Resume never trains over a run it could not resume, and every file a resume reads is checked (issue 45, items 1
and 5).

Item 1, measured on main: with ``checkpoint.keep_last=1`` a run keeps only step 8; one flipped byte in its
``.distcp`` made the next ``checkpoint.resume: auto`` run warn "falling back to an older one" when there was none,
start again from step 0, exit 0 and overwrite the run (its metrics and, at the next save, its checkpoints). Now that
run refuses -- exit status 2, one line naming each rejected checkpoint -- and keeps refusing on the next attempt (the
checkpoint is quarantined by then, and still counts); ``checkpoint.resume: restart`` is how a user says to start
again.

Item 5's resume part: a ``trainer.json`` that is not JSON, lacks a key, holds the wrong type or a negative
``consumed_samples``, and a rank file that would run code when unpickled, each in a checkpoint whose manifest was
recomputed (so it verifies), end the resume with exit status 2 and one ``error:`` line naming the file (and the key)
-- never a traceback, and never the code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loongforge.checkpoint import CheckpointDir, write_manifest
from loongforge.checkpoint.manifest import CheckpointCorruptError
from loongforge.checkpoint.saver import choose_resume
from loongforge.checkpoint.state_files import TASK_STATE, check_fields, load_plain, restore_checked, task_trainer_state
from loongforge.cli import main
from loongforge.errors import UntrustedCheckpointError
from torch.distributed import DistBackendError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
        "training.sample_tokens=0", "training.threads=1", "logging.progress=false", "logging.tensorboard=false",
        "scheduler.decay=constant"]


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _errors(capsys) -> tuple[list[str], str]:
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.startswith("error:")], err


def test_auto_resume_refuses_to_train_over_a_run_whose_checkpoints_all_fail(tmp_path, capsys):
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = ["train", QUICKSTART, *TINY, f"run.output_dir={out}", "checkpoint.interval=4", "checkpoint.keep_last=1"]
    assert main([*args, "training.steps=8"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000008"]
    weights = max((ckpts / "step-0000008" / "model_optim").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(weights)
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    assert main([*args, "training.steps=12"]) == 2  # used to print a warning, train from step 0 and exit 0
    errors, err = _errors(capsys)
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "checkpoint.resume: auto found checkpoints" in errors[0] and "none that verifies" in errors[0]
    assert f"step-0000008: file model_optim/{weights.name} does not match its sha256" in errors[0]
    assert "checkpoint.resume: restart" in errors[0]
    assert "falling back" not in err
    assert (out / "metrics.jsonl").read_bytes() == metrics  # the run was not touched
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000008.corrupt"]

    assert main([*args, "training.steps=12"]) == 2  # quarantined by now, and still no reason to start over
    errors, _ = _errors(capsys)
    assert len(errors) == 1 and "step-0000008.corrupt (quarantined by an earlier run)" in errors[0]
    assert (out / "metrics.jsonl").read_bytes() == metrics

    assert main([*args, "training.steps=12", "checkpoint.resume=restart"]) == 0  # the user says so
    err = capsys.readouterr().err
    assert "starting again from step 0 (checkpoint.resume: restart)" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000008.corrupt", "step-0000012"]


def _commit(root: Path, step: int, *, corrupt: bool = False) -> None:
    directory = CheckpointDir(root, keep_last=0)
    tmp = directory.begin(step)
    (tmp / "weights.bin").write_bytes(b"w" * 64)
    write_manifest(tmp, step=step)
    directory.commit(tmp, step)
    if corrupt:
        _flip(root / f"step-{step:07d}" / "weights.bin")


def test_the_resume_choice_falls_back_starts_fresh_or_refuses(tmp_path):
    lines: list[str] = []
    assert choose_resume(CheckpointDir(tmp_path / "empty"), "auto", lines.append) is None  # nothing there: step 0
    _commit(tmp_path, 4)
    _commit(tmp_path, 8, corrupt=True)
    assert choose_resume(CheckpointDir(tmp_path), "auto", lines.append) == tmp_path / "step-0000004"
    assert len(lines) == 1 and lines[0].endswith("falling back to the older step-0000004")

    (tmp_path / "step-0000004" / "weights.bin").write_bytes(b"x")  # now none verifies
    with pytest.raises(CheckpointCorruptError) as refused:
        choose_resume(CheckpointDir(tmp_path), "auto", lines.append)
    message = str(refused.value)
    assert "step-0000004: file weights.bin has 1 bytes, manifest says 64" in message
    assert "step-0000008.corrupt (quarantined by an earlier run)" in message and "\n" not in message
    lines.clear()
    assert choose_resume(CheckpointDir(tmp_path), "restart", lines.append) is None
    assert len(lines) == 1 and "starting again from step 0" in lines[0]
    assert choose_resume(CheckpointDir(tmp_path), "never", lines.append) is None


class _RunsCode:
    """Unpickled, creates ``marker``: what a crafted rank file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", QUICKSTART, *TINY, "training.steps=2", f"run.output_dir={out}"]) == 0
    return out / "checkpoints" / "step-0000002"


def _edit_trainer(edit):
    def apply(step: Path, marker: Path) -> None:
        path = step / "trainer.json"
        data = json.loads(path.read_text())
        text = edit(data)
        path.write_text(text if isinstance(text, str) else json.dumps(data))
    return apply


def _code_in_rank_file(step: Path, marker: Path) -> None:
    torch.save({"rng": _RunsCode(marker)}, step / "trainer-rank00000.pt")
    torch.load(step / "trainer-rank00000.pt", weights_only=False)  # the payload is live: it writes the marker
    assert marker.is_file()
    marker.unlink()


#: name -> (how the checkpoint is damaged, what the one error line must say)
DAMAGED = {
    "bad-json": (_edit_trainer(lambda data: '{"step": 2, "optimizer_steps": '),
                 "trainer.json: not valid JSON (Expecting value: line 1 column 32"),
    "missing-key": (_edit_trainer(lambda data: data.pop("optimizer_steps")), "trainer.json: 'optimizer_steps' is "
                                                                             "missing"),
    "wrong-type": (_edit_trainer(lambda data: data.update(step="2")), "trainer.json: 'step' must be an integer >= 0, "
                                                                      "got '2'"),
    "negative-consumed-samples": (_edit_trainer(lambda data: data["data"].update(consumed_samples=-4)),
                                  "trainer.json: 'data.consumed_samples' must be an integer >= 0, got -4"),
    "scheduler-not-a-mapping": (_edit_trainer(lambda data: data.update(scheduler=[1, 2])),
                                "trainer.json: 'scheduler' must be a mapping, got [1, 2]"),
    "code-in-rank-file": (_code_in_rank_file, "trainer-rank00000.pt (this rank's random streams) is not plain data (it "
                                              "names the global exec, which torch.load(weights_only=True) does not "
                                              "admit); loading it would run code"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_resume_file_is_one_line_naming_it(case, trained, tmp_path, capsys):
    damage, expected = DAMAGED[case]
    step = tmp_path / "checkpoints" / trained.name
    shutil.copytree(trained, step)
    marker = tmp_path / "marker"
    damage(step, marker)
    (step / "manifest.json").unlink()
    write_manifest(step, step=2)  # resealed: it verifies, as a checkpoint edited by someone (or something) would
    capsys.readouterr()
    code = main(["train", QUICKSTART, *TINY, "training.steps=4", f"run.output_dir={tmp_path / 'run'}",
                 f"checkpoint.resume={step}"])
    errors, err = _errors(capsys)
    assert code == 2 and len(errors) == 1, err
    assert "Traceback" not in err and expected in errors[0], errors[0]
    assert str(step) in errors[0]
    assert not marker.exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything was trained


def test_task_checkpoint_files_are_checked_too(tmp_path):
    """The task engine's ``trainer.json`` and ``state.pt`` (read with the same checks before its load uses them)."""
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps({"step": 3, "model": "dit", "world_size": 0}))
    with pytest.raises(CheckpointCorruptError, match=r"trainer.json: 'world_size' must be an integer >= 1, got 0"):
        task_trainer_state(path)
    path.write_text(json.dumps({"model": "dit"}))
    with pytest.raises(CheckpointCorruptError, match=r"trainer.json: 'step' is missing"):
        task_trainer_state(path)
    state = tmp_path / "state.pt"
    torch.save({"task": {}, "data_position": -1}, state)
    with pytest.raises(CheckpointCorruptError, match=r"state.pt: 'data_position' must be an integer >= 0, got -1"):
        check_fields(load_plain(state), TASK_STATE, str(state))
    marker = tmp_path / "marker"
    torch.save({"task": _RunsCode(marker), "data_position": 0}, state)
    with pytest.raises(UntrustedCheckpointError, match=r"state.pt \(the task's state\) is not plain data"):
        load_plain(state, "the task's state")
    assert not marker.exists()
    state.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointCorruptError, match=r"state.pt: unreadable"):
        load_plain(state)


def test_a_failed_collective_during_a_restore_is_no_damaged_file(tmp_path):
    """A state of the wrong shape is one line naming the file; another rank dying during a sharded load is not the
    file's fault: called corrupt (status 2), it would stop ``--max-restarts`` from restarting the job."""
    where = tmp_path / "optimizer.pt"

    def wrong_shape():
        raise RuntimeError("Error(s) in loading state_dict:\n  size mismatch for weight")

    def peer_died():
        raise DistBackendError("[gloo] Connection closed by peer")

    with pytest.raises(CheckpointCorruptError, match=r"optimizer.pt: the optimizer cannot be restored \(RuntimeError: "
                                                     r"Error\(s\) in loading state_dict:\)$"):
        restore_checked(wrong_shape, where, "the optimizer")
    with pytest.raises(DistBackendError):
        restore_checked(peer_died, where, "the optimizer")
