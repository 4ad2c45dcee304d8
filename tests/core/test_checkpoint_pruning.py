"""Pruning keeps the newest *verified* checkpoints: a corrupt one is quarantined (renamed ``step-N.corrupt``, never
counted, loaded or deleted), the checkpoint being written is never a candidate, ``latest`` never names a quarantined
checkpoint, and the pruner does not re-hash what this process already verified. Ends with issue 17's reproduction
(``checkpoint.keep_last=1`` and a corrupt newest checkpoint) run through the CLI on a tiny LLM."""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.checkpoint import CheckpointDir, list_checkpoints, verify_manifest
from loongforge.checkpoint import layout as layout_module
from loongforge.checkpoint.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[2]


def _save(ckpt: CheckpointDir, step: int) -> Path:
    tmp = ckpt.begin(step)
    (tmp / "weights.bin").write_bytes(b"weights" + bytes([step]))
    (tmp / "trainer.json").write_text(json.dumps({"step": step}))
    write_manifest(tmp, step=step)
    return ckpt.commit(tmp, step)


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _earlier_run(root: Path, steps: tuple[int, ...], corrupt: tuple[int, ...] = ()) -> None:
    """Checkpoints left by an earlier process (keep_last=0 so all stay), some then damaged on disk."""
    ckpt = CheckpointDir(root, keep_last=0)
    for step in steps:
        _save(ckpt, step)
    for step in corrupt:
        _flip(root / f"step-{step:07d}" / "weights.bin")


def test_resume_scan_quarantines_and_the_next_save_survives(tmp_path):
    _earlier_run(tmp_path, (8,), corrupt=(8,))
    lines: list[str] = []
    ckpt = CheckpointDir(tmp_path, keep_last=1, warn=lines.append)
    found, warnings = ckpt.find_valid()
    assert found is None
    assert len(warnings) == 1 and "step-0000008" in warnings[0] and "weights.bin" in warnings[0]
    assert "quarantined as step-0000008.corrupt" in warnings[0]
    assert _names(tmp_path) == ["step-0000008.corrupt"]  # the bad latest pointer went with it
    _save(ckpt, 4)
    assert _names(tmp_path) == ["latest", "step-0000004", "step-0000008.corrupt"]
    assert (tmp_path / "latest").read_text().strip() == "step-0000004"
    assert ckpt.find_valid() == (tmp_path / "step-0000004", [])
    assert lines == []


def test_pruner_quarantines_a_corrupt_newer_checkpoint_instead_of_counting_it(tmp_path):
    _earlier_run(tmp_path, (2, 4, 8), corrupt=(8,))
    lines: list[str] = []
    ckpt = CheckpointDir(tmp_path, keep_last=2, warn=lines.append)  # e.g. checkpoint.resume=never: no scan
    _save(ckpt, 10)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000010", "step-0000004"]
    assert (tmp_path / "step-0000008.corrupt" / "weights.bin").is_file()  # kept as evidence, not deleted
    assert len(lines) == 1 and "step-0000008" in lines[0] and "quarantined" in lines[0]
    assert "does not match its sha256" in lines[0]


def test_the_checkpoint_being_written_is_never_a_candidate(tmp_path):
    _earlier_run(tmp_path, (2, 8))  # a newer valid checkpoint from an earlier, longer run
    _save(CheckpointDir(tmp_path, keep_last=2), 4)  # the one written counts first, then the newest others
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000008", "step-0000004"]
    _save(CheckpointDir(tmp_path, keep_last=1), 3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000003"]
    assert (tmp_path / "latest").read_text().strip() == "step-0000003"


def test_a_steady_run_hashes_nothing_when_pruning(tmp_path, monkeypatch):
    calls: list[str] = []
    real = layout_module.verify_manifest
    monkeypatch.setattr(layout_module, "verify_manifest",
                        lambda path, **how: calls.append(Path(path).name) or real(path, **how))
    ckpt = CheckpointDir(tmp_path, keep_last=2)
    for step in (2, 4, 6, 8):
        _save(ckpt, step)
    assert calls == []
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000008", "step-0000006"]
    later = CheckpointDir(tmp_path, keep_last=2)  # a new process: it hashes only the one it would keep
    _save(later, 10)
    assert calls == ["step-0000008"]
    _save(later, 12)
    assert calls == ["step-0000008"]


def test_quarantine_never_overwrites_an_earlier_one_and_latest_moves_back(tmp_path):
    _earlier_run(tmp_path, (4, 8), corrupt=(8,))
    assert (tmp_path / "latest").read_text().strip() == "step-0000008"
    ckpt = CheckpointDir(tmp_path, keep_last=0)
    found, _ = ckpt.find_valid()
    assert found == tmp_path / "step-0000004"
    assert (tmp_path / "latest").read_text().strip() == "step-0000004"
    _save(ckpt, 8)
    _flip(tmp_path / "step-0000008" / "weights.bin")
    assert ckpt.find_valid()[0] == tmp_path / "step-0000004"
    assert _names(tmp_path) == ["latest", "step-0000004", "step-0000008.corrupt", "step-0000008.corrupt-2"]
    verify_manifest(tmp_path / "step-0000004")


def test_keep_last_1_with_a_corrupt_newest_checkpoint_end_to_end(tmp_path, capsys):
    """Issue 17 item 3: save 4 and 8, corrupt 8's weights; the next run (told to start again: ``resume: auto``
    refuses to train over checkpoints that all fail, issue 45) runs to step 6 without a final save, saves step 4
    and keeps it; step 8 is quarantined, not counted."""
    from loongforge.cli import main

    ckpts = tmp_path / "checkpoints"
    args = ["train", str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={tmp_path}",
            "model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
            "training.sample_tokens=0", "training.threads=1", "logging.progress=false", "checkpoint.interval=4",
            "checkpoint.keep_last=1"]
    assert main([*args, "training.steps=8"]) == 0
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-0000008"]
    weights = max((ckpts / "step-0000008" / "model_optim").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(weights)
    capsys.readouterr()
    assert main([*args, "training.steps=6", "checkpoint.save_at_end=false", "checkpoint.resume=restart"]) == 0
    err = capsys.readouterr().err
    quarantined = [line for line in err.splitlines() if "quarantined as step-0000008.corrupt" in line]
    assert len(quarantined) == 1 and weights.name in quarantined[0]
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-0000004"]
    assert (ckpts / "step-0000008.corrupt").is_dir()
    assert (ckpts / "latest").read_text().strip() == "step-0000004"
    verify_manifest(ckpts / "step-0000004")
    assert main([*args, "training.steps=6", "checkpoint.save_at_end=false"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpts / 'step-0000004'} at step 4" in out
