"""The diffusion plugin's commands under ``loongforge``: ``make-data moving-squares`` writes the dataset a run reads
(with progress per video, one-line errors for bad arguments), ``cache-latents`` and ``sample`` are listed, and
setting up their arguments imports no torch. ``cache-latents`` itself runs in test_latents.py (it needs the tiny
encoders built there)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from loongforge.cli import main
from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, TensorVideoDataset

pytestmark = pytest.mark.needs_plugins


def test_make_data_moving_squares_writes_what_a_run_reads_with_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    out = tmp_path / "data" / "squares.pt"
    assert main(["make-data", "moving-squares", str(out), "--count", "3", "--seed", "4", "--side", "20",
                 "--speed", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"generating moving squares for {out}: 3/3 video" in printed
    assert f"wrote 3 videos to {out}" in printed
    written = TensorVideoDataset(out)
    geometry = Geometry(frames=4, side=20, speed=3)  # frames left at its default
    assert written.geometry == geometry
    generated = MovingSquares(3, text_dim=32, seed=4, geometry=geometry)
    assert all(torch.equal(written[i][k], generated[i][k]) for i in range(3) for k in ("video", "context", "labels"))


@pytest.mark.parametrize(("args", "message"), [
    (["--count", "0"], "error: --count 0: must be at least 1"),
    (["--text-dim", "0"], "error: --text-dim 0: must be at least 1"),
    (["--frames", "9", "--side", "8"], "error: --frames/--side/--speed: Geometry(frames=9, side=8, speed=2): the "
                                       "largest square cannot travel 8 steps inside the frame"),
    (["--frames", "0"], "error: --frames/--side/--speed: Geometry(frames=0, side=16, speed=2): a video needs at "
                        "least one frame"),
])
def test_make_data_moving_squares_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    out = tmp_path / "squares.pt"
    assert main(["make-data", "moving-squares", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message)
    assert not out.exists()


def test_make_data_moving_squares_names_an_unwritable_output(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "squares.pt"
    assert main(["make-data", "moving-squares", str(out), "--count", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {out}: cannot write the dataset")


def test_commands_are_listed_and_set_up_without_torch():
    code = """
import contextlib, io, json, sys
from loongforge.cli import main
shown = {}
for argv in (["--help"], ["make-data", "--help"], ["make-data", "moving-squares", "--help"],
             ["cache-latents", "--help"], ["sample", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.suppress(SystemExit):
        main(argv)
    shown[" ".join(argv)] = printed.getvalue()
assert "torch" not in sys.modules, "torch imported"
print(json.dumps(shown))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert "cache-latents" in shown["--help"] and "sample" in shown["--help"]
    assert "moving-squares" in shown["make-data --help"] and "[loongforge-diffusion]" in shown["make-data --help"]
    assert all(flag in shown["make-data moving-squares --help"] for flag in ("--count", "--text-dim", "--speed"))
    assert all(flag in shown["cache-latents --help"] for flag in ("--vae", "--text-encoder", "--videos", "--dtype"))
    assert "index.json" in shown["sample --help"]


def test_cache_latents_names_a_directory_that_is_no_model(tmp_path, capsys):
    (tmp_path / "vae").mkdir()
    args = ["cache-latents", "--vae", str(tmp_path / "vae"), "--text-encoder", str(tmp_path), "--videos",
            str(tmp_path), "--out", str(tmp_path / "cache")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --vae {tmp_path / 'vae'}: no config.json")
