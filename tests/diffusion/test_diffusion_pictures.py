"""Diffusion samples a person looks at: after training, and from ``loongforge sample``, the sample files come with a
captioned grid (``grid.gif`` for videos, ``grid.png`` for images) and ``index.json``; the run's trackers get the
samples with their captions through the :class:`~loongforge.train.media.MediaLog` a task's ``finish`` is given
(TensorBoard included); and the denoising steps show as progress."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from loongforge.cli import main
from loongforge.train.task_checkpoint import load_task_model
from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, caption
from loongforge_diffusion.data.still_squares import StillSquares
from loongforge_diffusion.media import CAPTION_BACKGROUND, GRID_BACKGROUND, GUTTER, wrap_caption
from loongforge_diffusion.run_options import HELD_OUT_SEED_OFFSET
from PIL import Image, ImageFont, ImageSequence

pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
WAN = str(ROOT / "configs/diffusion-moving-squares.yaml")
QWEN = str(ROOT / "configs/diffusion-squares-image.yaml")
CHEAP = ["logging.progress=false", "training.threads=1", "training.steps=2", "checkpoint.interval=0"]
WAN_TILE, QWEN_TILE = 8 * 12, 8 * 16  # the configs' frame sides, enlarged 8x


class RecordingMedia:
    """A :class:`~loongforge.train.media.MediaLog` that keeps every call (what a tracker would be given)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def images(self, tag, images, captions, *, step):
        self.calls.append({"kind": "images", "tag": tag, "pictures": list(images), "captions": list(captions),
                           "step": step})

    def videos(self, tag, videos, captions, *, step, fps):
        self.calls.append({"kind": "videos", "tag": tag, "pictures": list(videos), "captions": list(captions),
                           "step": step, "fps": fps})


def _train(config: str, out: Path, *overrides: str) -> str:
    """``loongforge train`` with plain progress; returns what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("LOONGFORGE_PROGRESS", "plain")
        assert main(["train", config, f"run.output_dir={out}", *CHEAP, *overrides]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan") / "run"
    printed = _train(WAN, out, "task.samples=32", "logging.tensorboard=true", "task.sample={videos: 3, steps: 2}")
    return out, printed


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen") / "run"
    printed = _train(QWEN, out, "task.samples=32", "training.micro_batch_size=8", "model.overrides.num_layers=2",
                     "logging.tensorboard=false", "task.sample={images: 3, steps: 2}")
    return out, printed


def _held_out_captions(count: int, *, still: bool) -> list[str]:
    """The captions the tasks sample after training: the held-out data seed's (configs: data_seed 0)."""
    seed = HELD_OUT_SEED_OFFSET
    if still:
        items = StillSquares(count, text_dim=8, seed=seed, side=16)
    else:
        items = MovingSquares(count, text_dim=8, seed=seed, geometry=Geometry(frames=4, side=12, speed=2))
    return [caption(items[i]["labels"], moving=not still) for i in range(count)]


def _frames(path: Path) -> np.ndarray:
    """Every frame of an image file as ``uint8`` RGB ``(T, H, W, 3)``."""
    return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(Image.open(path))])


def _width(columns: int, side: int) -> int:
    """A grid's width: ``columns`` tiles of ``side`` pixels with a gutter between neighbours."""
    return columns * side + (columns - 1) * GUTTER


def _strip(grid_height: int, rows: int, side: int) -> int:
    """The caption strip's height, from the grid's: rows of equal tiles (a picture over its caption) and gutters."""
    assert (grid_height + GUTTER) % rows == 0
    strip = (grid_height + GUTTER) // rows - GUTTER - side
    assert strip > 0
    return strip


def _origin(number: int, columns: int, side: int, strip: int) -> tuple[int, int]:
    """Top-left pixel of tile ``number``."""
    return number // columns * (side + strip + GUTTER), number % columns * (side + GUTTER)


def _tile(grid: np.ndarray, number: int, columns: int, side: int, strip: int) -> np.ndarray:
    """The picture part of tile ``number`` of grid frames ``(T, H, W, 3)``."""
    top, left = _origin(number, columns, side, strip)
    return grid[:, top:top + side, left:left + side]


def test_a_wan_run_writes_a_captioned_grid_and_index_of_its_held_out_samples(wan_run):
    out, printed = wan_run
    samples = out / "samples"
    captions = _held_out_captions(3, still=False)
    rows = json.loads((samples / "index.json").read_text())
    assert rows == [{"file": f"sample-{i:03d}.gif", "caption": captions[i], "seed": 0, "steps": 2, "guidance": 3.0,
                     "sampler": "euler"} for i in range(3)]
    grid = _frames(samples / "grid.gif")
    assert grid.shape[0] == 4  # the clips' frames, playing together
    assert grid.shape[2] == _width(2, WAN_TILE)  # 3 tiles: 2 columns, 2 rows
    strip = _strip(grid.shape[1], 2, WAN_TILE)
    for number in range(3):  # each tile shows its own sample (GIF palettes differ by a few levels)
        tile = _tile(grid, number, 2, WAN_TILE, strip).astype(int)
        distances = [np.abs(tile - _frames(samples / f"sample-{i:03d}.gif")).mean() for i in range(3)]
        assert int(np.argmin(distances)) == number and distances[number] < 8
    empty, gutter = _tile(grid, 3, 2, WAN_TILE, strip), grid[:, :WAN_TILE, WAN_TILE:WAN_TILE + GUTTER]
    for plain in (empty, gutter):  # the fourth tile is empty; a gutter parts tiles 0 and 1 (GIF: within 2 levels)
        assert np.abs(plain.astype(int) - GRID_BACKGROUND).max() <= 2
    assert "sampling 3 videos: 2/2 step" in printed  # the end-of-run sampling's progress
    assert f"samples grid: {samples / 'grid.gif'}" in printed


def test_wan_finish_sends_uint8_videos_with_their_captions_to_the_media_log(wan_run, tmp_path):
    out, _ = wan_run
    task, model, _ = load_task_model(out / "checkpoints")
    media = RecordingMedia()
    summary = task.finish(model, tmp_path, media)
    [call] = media.calls
    assert {k: call[k] for k in ("kind", "tag", "captions", "step", "fps")} == {
        "kind": "videos", "tag": "samples", "captions": _held_out_captions(3, still=False), "step": 2, "fps": 4}
    for number, video in enumerate(call["pictures"]):
        assert video.dtype == np.uint8 and video.shape == (4, WAN_TILE, WAN_TILE, 3)
        written = _frames(tmp_path / "samples" / f"sample-{number:03d}.gif")
        assert np.abs(written.astype(int) - video).max() <= 2  # what was logged is what was written
    assert summary["samples_grid"] == str(tmp_path / "samples" / "grid.gif")


def test_tensorboard_gets_the_samples_with_their_captions(wan_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = wan_run
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert sorted(tag for tag in events.Tags()["images"] if tag.startswith("samples/")) == \
        ["samples/0", "samples/1", "samples/2"]
    for number, text in enumerate(_held_out_captions(3, still=False)):
        [image] = events.Images(f"samples/{number}")
        assert image.step == 2 and (image.width, image.height) == (WAN_TILE, WAN_TILE)
        gif = Image.open(io.BytesIO(image.encoded_image_string))
        assert gif.format == "GIF" and gif.n_frames == 4
        [note] = events.Tensors(f"samples/{number}/text_summary")
        assert note.tensor_proto.string_val[0].decode() == text


def test_a_qwen_image_run_tiles_its_pngs_exactly_and_logs_images(qwen_run, tmp_path):
    out, printed = qwen_run
    samples = out / "samples"
    captions = _held_out_captions(3, still=True)
    assert json.loads((samples / "index.json").read_text()) == [
        {"file": f"sample-{i:03d}.png", "caption": captions[i], "seed": 0, "steps": 2, "guidance": 3.0,
         "sampler": "euler"} for i in range(3)]
    grid = _frames(samples / "grid.png")
    assert grid.shape[0] == 1 and grid.shape[2] == _width(2, QWEN_TILE)
    strip = _strip(grid.shape[1], 2, QWEN_TILE)
    for number in range(3):  # PNG is lossless: every tile is its sample, pixel for pixel
        assert np.array_equal(_tile(grid, number, 2, QWEN_TILE, strip), _frames(samples / f"sample-{number:03d}.png"))
        top, left = _origin(number, 2, QWEN_TILE, strip)
        under = grid[0, top + QWEN_TILE:top + QWEN_TILE + strip, left:left + QWEN_TILE]
        assert (under == CAPTION_BACKGROUND).all(axis=-1).mean() > 0.5 and under.max() > 200  # text on the strip
    assert "sampling 3 images: 2/2 step" in printed

    task, model, _ = load_task_model(out / "checkpoints")
    media = RecordingMedia()
    task.finish(model, tmp_path, media)
    [call] = media.calls
    assert {k: call[k] for k in ("kind", "tag", "captions", "step")} == {
        "kind": "images", "tag": "samples", "captions": captions, "step": 2}
    for number, image in enumerate(call["pictures"]):
        assert image.dtype == np.uint8 and image.shape == (QWEN_TILE, QWEN_TILE, 3)
        assert np.array_equal(image, _frames(tmp_path / "samples" / f"sample-{number:03d}.png")[0])


def test_sample_command_writes_a_grid_tiling_its_samples_and_an_index_of_the_prompts(qwen_run, wan_run, tmp_path,
                                                                                        capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    prompts = ["a red square of size 4", "blue 3", "a yellow square of size 5"]
    args = ["sample", str(qwen_run[0] / "checkpoints"), "--steps", "2", "--seed", "5", "--guidance", "2",
            "--out", str(tmp_path / "png"), "--format", "png", "--sampler", "dpm++"]
    assert main(args + [arg for prompt in prompts for arg in ("--prompt", prompt)]) == 0
    printed = capsys.readouterr().out
    assert "sampling 3 images: 2/2 step" in printed
    assert f"captioned grid and index.json in {tmp_path / 'png'}" in printed
    rows = json.loads((tmp_path / "png" / "index.json").read_text())
    assert rows == [{"file": f"sample-{i:03d}.png", "caption": prompts[i], "seed": 5, "steps": 2, "guidance": 2.0,
                     "sampler": "dpm++"} for i in range(3)]
    grid = _frames(tmp_path / "png" / "grid.png")
    side = Image.open(tmp_path / "png" / "sample-000.png").width
    assert grid.shape[2] == _width(2, side)
    strip = _strip(grid.shape[1], 2, side)
    for number in range(3):
        written = _frames(tmp_path / "png" / f"sample-{number:03d}.png")
        assert np.array_equal(_tile(grid, number, 2, side, strip), written)

    videos = ["a red square of size 4 moving right", "blue 3 up"]
    args = ["sample", str(wan_run[0] / "checkpoints"), "--steps", "2", "--out", str(tmp_path / "gif"),
            "--sampler", "unipc"]
    assert main(args + [arg for prompt in videos for arg in ("--prompt", prompt)]) == 0
    assert "sampling 2 videos: 2/2 step" in capsys.readouterr().out
    grid = _frames(tmp_path / "gif" / "grid.gif")
    assert grid.shape[0] == 4 and grid.shape[2] == _width(2, WAN_TILE)  # 2 tiles: one row of two
    _strip(grid.shape[1], 1, WAN_TILE)
    rows = json.loads((tmp_path / "gif" / "index.json").read_text())
    assert [(row["caption"], row["sampler"]) for row in rows] == [(video, "unipc") for video in videos]


def test_captions_wrap_at_spaces_and_long_ones_end_in_an_ellipsis():
    font = ImageFont.load_default()
    assert wrap_caption("a red square", font, 200) == ["a red square"]
    lines = wrap_caption("a red square of size 4 moving right", font, 100)
    assert " ".join(lines) == "a red square of size 4 moving right" and 1 < len(lines) <= 3
    assert all(font.getlength(line) <= 100 for line in lines)
    pairs = zip(lines, lines[1:], strict=False)
    assert all(font.getlength(f"{line} {after.split()[0]}") > 100 for line, after in pairs)  # greedy: no word fits up
    long = wrap_caption("the quick brown fox jumps over the lazy dog " * 4, font, 60)
    assert len(long) == 3 and long[-1].endswith("...") and all(font.getlength(line) <= 60 for line in long)
    word = wrap_caption("x" * 80, font, 40, lines=10)  # a word wider than the tile is cut inside
    assert "".join(word) == "x" * 80 and all(font.getlength(line) <= 40 for line in word) and len(word) > 1
