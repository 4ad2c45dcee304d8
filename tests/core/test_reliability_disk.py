"""A full disk is named as such, with the bytes the save needs (issue 45, item 6).

Measured on main: a save into a full disk ended in torch's ``RuntimeError: [enforce fail at inline_container.cc]
. unexpected pos 704 vs 598`` (its C++ writer hides the errno) and a traceback, and nothing said that
``checkpoint.keep_last: 1`` needs room for two checkpoints -- the new one is complete before the old one is deleted.

Now every checkpoint file torch writes goes through a Python file object (so a full disk is the ``OSError`` ENOSPC
it is), and a save that finds no room -- in the main thread or in the writer -- ends the run with exit status 2 and
one line: "no space left on device", the file, the bytes the checkpoint needs (the size of the last one) and those
free, and what ``keep_last`` implies; the partial save is removed so its space is free again, and the previous
checkpoint is untouched. A save that will probably not fit is announced by a warning line before it starts.

The disk is filled by ``/dev/full`` (every write fails with ENOSPC) put in place of one file of the save by a plugin,
which works on any Linux machine without privileges; the free space the warning and the line report comes from
``shutil.disk_usage``, which the tests that need a nearly full disk replace.
"""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from loongforge import hookimpl
from loongforge.checkpoint import CheckpointDir, verify_manifest, write_manifest
from loongforge.checkpoint.writer import save_torch, warn_if_no_room, write_failure
from loongforge.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
        "training.sample_tokens=0", "training.threads=1", "logging.progress=false", "logging.tensorboard=false"]


class FullDisk:
    """While checkpoint ``at`` is written, its file ``name`` is ``/dev/full``: every write to it fails (ENOSPC)."""

    def __init__(self, name: str, at: int) -> None:
        self.name, self.at = name, at

    @hookimpl
    def loongforge_on_checkpoint_save(self, trainer, path):
        if trainer.step == self.at:
            target = Path(path) / self.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to("/dev/full")


@pytest.mark.parametrize("name", ["trainer.json", "model_optim/__0_0.distcp"], ids=["main-thread", "writer"])
def test_a_full_disk_is_one_line_with_the_bytes_needed(name, tmp_path, capsys, register_plugin):
    register_plugin(FullDisk(name, at=4), "full-disk")
    out = tmp_path / "run"
    code = main(["train", QUICKSTART, *TINY, "training.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=1",
                 f"run.output_dir={out}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    ckpts = out / "checkpoints"
    size = sum(f.stat().st_size for f in (ckpts / "step-0000002").rglob("*") if f.is_file())
    line = errors[0]
    assert "checkpoint step 4 was not saved (" in line and "no space left on device" in line, line
    assert "unexpected pos" not in line
    assert f"needs about {size / 2**20:.1f} MiB (the size of step-0000002)" in line, line
    assert "was free for it in" in line, line
    assert "checkpoint.keep_last 1 keeps 1 checkpoint(s)" in line and "the disk must hold 2 at once" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000002"]  # the partial save is gone
    verify_manifest(ckpts / "step-0000002")


def test_torch_files_are_written_so_that_a_full_disk_is_enospc(tmp_path):
    """The cause of the cryptic line: ``torch.save`` to a *path* reports a full disk as "unexpected pos"; through a
    file object it is ENOSPC, which :func:`write_failure` names with the bytes needed."""
    full = tmp_path / "full.pt"
    full.symlink_to("/dev/full")
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"x": torch.zeros(1000)}, full)  # what main did
    with pytest.raises(OSError) as raised:
        save_torch({"x": torch.zeros(1000)}, full)
    assert raised.value.errno == errno.ENOSPC
    directory = CheckpointDir(tmp_path / "ckpts", keep_last=2)
    line = write_failure(raised.value, directory, step=6)
    assert line.startswith("no space left on device: the checkpoint needs more than the 0 B it had written")
    assert "keep_last 2 keeps 2 checkpoint(s)" in line and "must hold 3 at once" in line
    assert write_failure(ValueError("a bug"), directory, step=6) is None  # other errors stay what they are


def _free(monkeypatch, free: int) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - free, free))


def _one_checkpoint(root: Path, size: int) -> CheckpointDir:
    directory = CheckpointDir(root, keep_last=1)
    tmp = directory.begin(2)
    (tmp / "weights.bin").write_bytes(b"w" * size)
    write_manifest(tmp, step=2)
    directory.commit(tmp, 2)
    return directory


def test_a_save_that_will_not_fit_is_announced_and_a_short_write_is_named(tmp_path, capsys, monkeypatch):
    """``keep_last: 1`` needs room for two checkpoints: with less free than the last one took, a warning comes before
    the save; torch's "unexpected pos" from a write it made through a path (a plugin's ``torch.save``) is taken for
    a full disk only when the disk is in fact nearly full."""
    directory = _one_checkpoint(tmp_path / "ckpts", 300 << 10)
    short_write = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 704 vs 598")
    _free(monkeypatch, 1 << 40)
    warn_if_no_room(directory, 4)
    assert capsys.readouterr().err == ""
    assert write_failure(short_write, directory, step=4) is None  # room enough: some other failure

    _free(monkeypatch, 100 << 10)
    warn_if_no_room(directory, 4)
    (warning,) = capsys.readouterr().err.splitlines()
    assert "checkpoint step 4: 100.0 KiB free in" in warning and "but step-0000002 took 300." in warning
    assert "the save will probably fail for lack of space" in warning and "must hold 2 at once" in warning
    line = write_failure(short_write, directory, step=4)
    assert line.startswith("no space left on device: the checkpoint needs about 300."), line
    assert "KiB (the size of step-0000002), and 100.0 KiB was free for it in" in line
