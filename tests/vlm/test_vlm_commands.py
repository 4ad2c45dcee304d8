"""The vlm plugin's commands as a user runs them (``loongforge eval``, ``loongforge convert``, ``loongforge make-data
shapes``), with the progress each shows on standard error in plain mode: one line per question with the accuracy so
far, one per tensor with its name, one per image. Standard output keeps each command's result alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from loongforge import load_config
from loongforge.cli import main
from loongforge_vlm.model.flavors import FLAVORS
from safetensors import safe_open
from vlm_reference import reference_model

pytestmark = pytest.mark.needs_plugins

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vlm-shapes.yaml"
LINE = re.compile(r"^(?P<what>[^:]+(?::[^:]+)?): (?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+) \([\d,.]+/s, [^)]*\)"
                  r"(?: \[(?P<note>.*)\])?$")


@pytest.fixture
def every_step(monkeypatch):
    """Plain progress with a line at every step (the interval is 10 s otherwise)."""
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("loongforge.progress.PLAIN_EVERY_S", 0.0)


def _lines(err: str, description: str) -> list[re.Match]:
    matches = [LINE.match(line) for line in err.splitlines()]
    return [m for m in matches if m is not None and m["what"] == description]


def test_eval_shows_each_question_with_the_running_accuracy(tmp_path, capsys, every_step):
    from loongforge.train.run import run_training

    run_training(load_config(CONFIG, [f"run.output_dir={tmp_path / 'run'}", "logging.progress=false",
                                      "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
                                      "scheduler.warmup_steps=1", "training.steps=2"]))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run" / "checkpoints"), "--limit", "5"]) == 0
    captured = capsys.readouterr()
    shown = _lines(captured.err, "answering held-out questions")
    assert [(int(m["done"]), int(m["total"]), m["unit"]) for m in shown] == [(n, 5, "question") for n in range(1, 6)]
    # the note is right answers / answered so far: each step adds 0 or 1 right answer
    right = [Fraction(m["note"].removeprefix("accuracy ")) * int(m["done"]) for m in shown]
    assert all(abs(r - round(r)) < Fraction(1, 100) for r in right)
    counts = [round(r) for r in right]
    assert all(later - earlier in (0, 1) for earlier, later in zip([0, *counts], counts, strict=False))
    saved = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/eval.json")).read_text())
    assert saved["overall"]["n"] == 5 and saved["overall"]["accuracy"] == counts[-1] / 5
    assert f"overall  n=   5  accuracy {counts[-1] / 5:.3f}" in captured.out
    assert "answering" not in captured.out


def test_convert_shows_every_tensor_both_ways(tmp_path, capsys, every_step):
    reference_model(FLAVORS["qwen2-vl-tiny"]).save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        names = sorted(handle.keys())  # noqa: SIM118 - safe_open has no __iter__
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    captured = capsys.readouterr()
    read = _lines(captured.err, "reading Hugging Face tensors")
    assert [(int(m["done"]), int(m["total"])) for m in read] == [(n, len(names)) for n in range(1, len(names) + 1)]
    assert [m["note"] for m in read] == names  # one line per tensor, named, in file order
    written = _lines(captured.err, "writing checkpoint tensors")
    total = int(written[-1]["total"])
    assert total >= len(names) and [int(m["done"]) for m in written] == list(range(1, total + 1))
    assert captured.out.startswith(f"wrote {tmp_path / 'ours'}: {len(names)} Hugging Face tensors")

    assert main(["convert", "mcore-to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    captured = capsys.readouterr()
    back = _lines(captured.err, "writing Hugging Face tensors")
    assert [(int(m["done"]), int(m["total"]), m["note"]) for m in back] == [(len(names), len(names),
                                                                            "model.safetensors")]
    (summary,) = captured.out.splitlines()  # the progress stays off standard output
    assert summary.startswith(f"wrote {tmp_path / 'back'}: {len(names)} tensors (Qwen2VLForConditionalGeneration")


def test_make_data_shapes_is_listed_and_shows_every_image(tmp_path, capsys, every_step):
    with pytest.raises(SystemExit):
        main(["make-data", "--help"])
    assert re.search(r"shapes\s+synthetic shapes VQA images .*\[loongforge-vlm\]", capsys.readouterr().out, re.S)
    assert main(["make-data", "shapes", str(tmp_path / "wds"), "--count", "6", "--seed", "3", "--format", "wds",
                 "--shard-size", "4"]) == 0
    captured = capsys.readouterr()
    meta = json.loads((tmp_path / "wds" / "meta.json").read_text())
    shown = _lines(captured.err, f"drawing shapes into {tmp_path / 'wds'}")
    assert [(int(m["done"]), int(m["total"]), m["unit"]) for m in shown] == [(n, 6, "image") for n in range(1, 7)]
    members = [m["note"] for m in shown]  # shard:member of each image, every shard of the meta in order
    assert sorted({note.split(":")[0] for note in members}) == sorted(sum(meta["shards"].values(), []))
    assert len(set(members)) == 6
    assert captured.out.splitlines() == [f"wrote {meta['splits']['train']} train + {meta['splits']['heldout']} "
                                         f"held-out samples to {tmp_path / 'wds'}", f"{tmp_path / 'wds'}: valid"]


def test_make_data_shapes_bad_options_are_one_line(tmp_path, capsys):
    for option, value, message in (("--format", "tar", "--format must be one of jsonl, wds, got 'tar'"),
                                   ("--count", "0", "--count must be positive, got 0"),
                                   ("--heldout-fraction", "1.0", "--heldout-fraction must lie in [0, 1), got 1.0")):
        assert main(["make-data", "shapes", str(tmp_path / "bad"), option, value]) == 2
        assert capsys.readouterr().err == f"error: shapes: {message}\n"
    assert not (tmp_path / "bad").exists()


def test_the_old_module_front_end_says_where_it_went(tmp_path):
    done = subprocess.run([sys.executable, "-m", "loongforge_vlm.data.shapes", str(tmp_path / "old")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and not (tmp_path / "old").exists()
    assert done.stderr == "python -m loongforge_vlm.data.shapes is now `loongforge make-data shapes OUT_DIR ...`\n"
