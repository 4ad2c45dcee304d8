"""Checkpoint directory mechanics without torch: manifest verification, atomic commit, pruning, fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loongforge.checkpoint import CheckpointCorruptError, CheckpointDir, list_checkpoints, verify_manifest
from loongforge.checkpoint.manifest import write_manifest


def _save(ckpt: CheckpointDir, step: int, payload: bytes = b"weights") -> Path:
    tmp = ckpt.begin(step)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "data.bin").write_bytes(payload + bytes([step]))
    (tmp / "trainer.json").write_text(json.dumps({"step": step}))
    write_manifest(tmp, step=step)
    return ckpt.commit(tmp, step)


def test_commit_renames_and_points_latest(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=0)
    final = _save(ckpt, 6)
    assert final.name == "step-0000006"
    assert (tmp_path / "latest").read_text().strip() == "step-0000006"
    assert ckpt.latest() == final
    assert not list(tmp_path.glob(".tmp-*"))
    manifest = verify_manifest(final)
    assert set(manifest["files"]) == {"sub/data.bin", "trainer.json"}


def test_keep_last_prunes_oldest(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=2)
    for step in (2, 4, 6, 8):
        _save(ckpt, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000008", "step-0000006"]


def test_tmp_dirs_are_never_candidates_and_are_cleared_by_next_save(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=0)
    _save(ckpt, 6)
    half = tmp_path / ".tmp-step-0000009"
    half.mkdir()
    (half / "trainer.json").write_text("{")  # a save killed half-way
    assert ckpt.find_valid() == (tmp_path / "step-0000006", [])
    _save(ckpt, 12)
    assert not half.exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "sub" / "data.bin").write_bytes(b"weightX\x0c"), "sub/data.bin does not match its sha256"),
        (lambda d: (d / "sub" / "data.bin").write_bytes(b"short"), "sub/data.bin has 5 bytes"),
        (lambda d: (d / "sub" / "data.bin").unlink(), "sub/data.bin is missing"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    ],
)
def test_damage_is_reported_in_one_line_naming_checkpoint_and_file(tmp_path, damage, message):
    ckpt = CheckpointDir(tmp_path, keep_last=0)
    older = _save(ckpt, 6)
    newest = _save(ckpt, 12)
    damage(newest)
    with pytest.raises(CheckpointCorruptError) as info:
        verify_manifest(newest)
    assert message in str(info.value) and str(newest) in str(info.value)
    assert "\n" not in str(info.value)
    found, warnings = ckpt.find_valid()
    assert found == older
    assert len(warnings) == 1 and message in warnings[0] and "falling back" in warnings[0]


def test_no_valid_checkpoint(tmp_path):
    assert CheckpointDir(tmp_path / "missing").find_valid() == (None, [])


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=0)
    _save(ckpt, 6, b"old")
    final = _save(ckpt, 6, b"new")
    assert (final / "sub" / "data.bin").read_bytes().startswith(b"new")
    verify_manifest(final)
    assert not list(tmp_path.glob(".tmp-*"))


def test_packages_import_without_torch():
    import subprocess
    import sys

    code = "import sys, loongforge.checkpoint, loongforge.train; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
