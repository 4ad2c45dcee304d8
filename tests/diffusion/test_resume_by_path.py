"""Issue 17 item 4: resuming a task model (the diffusion DiT) from a checkpoint *by path* verifies its manifest
first. Two flipped bytes in ``model.safetensors`` end the run with one line naming the file and exit 2, before
anything is trained or written; the intact checkpoint resumes (the same command works)."""

from __future__ import annotations

from pathlib import Path

from loongforge.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", str(ROOT / "configs/diffusion-moving-squares.yaml"), f"run.output_dir={out}",
            "model.overrides.num_layers=1", "task.samples=16", "task.sample={videos: 0}", "training.threads=1",
            "training.micro_batch_size=2", "logging.progress=false", "checkpoint.interval=2", *extra]


def test_a_corrupt_task_checkpoint_named_by_path_is_refused_in_one_line(tmp_path, capsys):
    assert main(_args(tmp_path / "first", "training.steps=2")) == 0
    checkpoint = tmp_path / "first" / "checkpoints" / "step-0000002"
    weights = checkpoint / "model.safetensors"
    intact = weights.read_bytes()
    damaged = bytearray(intact)
    for offset in (len(damaged) // 2, len(damaged) - 3):  # inside the tensor data, past the safetensors header
        damaged[offset] ^= 0x01
    weights.write_bytes(bytes(damaged))
    capsys.readouterr()

    resumed = tmp_path / "resumed"
    assert main(_args(resumed, "training.steps=4", f"checkpoint.resume={checkpoint}")) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: checkpoint {checkpoint}: file model.safetensors does not match its sha256 in "
                      "manifest.json"]
    assert "Traceback" not in captured.err
    assert "step 1/4" not in captured.out and "step 3/4" not in captured.out  # nothing trained
    # Nothing was saved or recorded (the directories themselves were proved writable before step 1).
    assert not list((resumed / "checkpoints").glob("*step-*")) and not (resumed / "metrics.jsonl").exists()
    assert checkpoint.is_dir() and not list(checkpoint.parent.glob("*.corrupt"))  # a named path is not moved

    weights.write_bytes(intact)  # the same command with the intact checkpoint resumes at step 2
    assert main(_args(resumed, "training.steps=4", f"checkpoint.resume={checkpoint}")) == 0
    assert f"resumed from {checkpoint} at step 2" in capsys.readouterr().out
    assert (resumed / "checkpoints" / "step-0000004").is_dir()
