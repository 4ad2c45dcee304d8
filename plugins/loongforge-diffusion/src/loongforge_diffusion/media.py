"""Writing sampled videos and images where a person can look at them.

One sample is a looping GIF (Pillow), an MP4 (PyAV, H.264), a folder of PNG frames, or -- for a still image -- one
PNG/GIF. A batch of samples (:func:`write_samples`) also gets what makes it quick to judge: a captioned grid
(``grid.png`` for images, ``grid.gif`` for videos: every sample a tile with its caption under it, all tiles playing
together) and ``index.json`` (per sample its file, caption, seed, steps and guidance, so any picture can be traced
to the prompt and settings that made it). The same pixels go to the run's trackers through
:class:`~loongforge.train.media.MediaLog` (:meth:`Gallery.log`).

Samples are ``(3, T, H, W)`` tensors in [-1, 1]; small ones are enlarged with nearest-neighbour (``SCALE``) so
pixels stay crisp, and every picture written, tiled or logged is that enlarged ``uint8`` array.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from loongforge.errors import ConfigError
from loongforge.train.media import MediaLog, gif_bytes

FORMATS = ("gif", "mp4", "png")
#: Nearest-neighbour enlargement of every written sample (a 12 x 12 square video becomes 96 x 96).
SCALE = 8
#: Playback rate of written and logged videos.
FPS = 4
#: Lines of caption under each grid tile; a longer caption is cut with "...".
CAPTION_LINES = 3
CAPTION_BACKGROUND = (32, 32, 32)
CAPTION_TEXT = (235, 235, 235)
#: Pixels between neighbouring grid tiles, and their colour (also that of the empty tiles of the last row).
GUTTER = 2
GRID_BACKGROUND = (96, 96, 96)
#: Tag of the samples in the run's trackers.
SAMPLES_TAG = "samples"
INDEX = "index.json"


def to_pixels(video: torch.Tensor, scale: int = SCALE) -> np.ndarray:
    """A ``(3, T, H, W)`` video in [-1, 1] as ``uint8`` frames ``(T, H * scale, W * scale, 3)``."""
    pixels = ((video.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    frames = pixels.permute(1, 2, 3, 0).numpy()
    return np.ascontiguousarray(frames.repeat(scale, axis=1).repeat(scale, axis=2))


def write_video(video: torch.Tensor, stem: Path, fmt: str = "gif", *, fps: int = FPS, scale: int = SCALE) -> Path:
    """Write one video as ``stem.gif``, ``stem.mp4`` or ``stem/frame-000.png ...``; return the path written."""
    return _write_frames(to_pixels(video, scale), stem, fmt, fps)


def _write_frames(frames: np.ndarray, stem: Path, fmt: str, fps: int) -> Path:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown sample format '{fmt}'; use one of {', '.join(FORMATS)}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "gif":
        path = stem.with_suffix(".gif")
        path.write_bytes(gif_bytes(frames, fps))
        return path
    if fmt == "png":
        from PIL import Image

        stem.mkdir(exist_ok=True)
        for index, frame in enumerate(frames):
            Image.fromarray(frame).save(stem / f"frame-{index:03d}.png")
        return stem
    return _write_mp4(frames, stem.with_suffix(".mp4"), fps)


def _write_mp4(frames: np.ndarray, path: Path, fps: int) -> Path:
    try:
        import av
    except ImportError:
        raise ConfigError("mp4 output needs PyAV: pip install 'loongforge-diffusion[video]' (or use gif)") from None

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        # H.264 with yuv420p wants even sides.
        stream.width, stream.height = frames.shape[2] // 2 * 2, frames.shape[1] // 2 * 2
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            array = np.ascontiguousarray(frame[: stream.height, : stream.width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@dataclass(frozen=True)
class SampleSettings:
    """How a batch was sampled: what ``index.json`` records next to each caption."""

    seed: int
    steps: int
    guidance: float
    sampler: str = "euler"


@dataclass(frozen=True)
class Gallery:
    """A written batch of samples: one file per sample, the grid, the index, and the pixels they hold."""

    files: list[Path]
    captions: list[str]
    #: ``uint8`` frames ``(T, H, W, 3)`` per sample (``T = 1`` for a still image), as written.
    clips: list[np.ndarray]
    still: bool
    grid: Path
    index: Path

    def log(self, media: MediaLog, *, step: int, tag: str = SAMPLES_TAG, fps: int = FPS) -> None:
        """Send the samples with their captions to the run's trackers: images for stills, videos otherwise."""
        if self.still:
            media.images(tag, [clip[0] for clip in self.clips], self.captions, step=step)
        else:
            media.videos(tag, self.clips, self.captions, step=step, fps=fps)


def write_samples(videos: torch.Tensor, captions: Sequence[str], directory: Path, settings: SampleSettings, *,
                  fmt: str = "gif", still: bool = False) -> Gallery:
    """Write a batch ``(B, 3, T, H, W)`` of samples into ``directory``: ``sample-000.<fmt>`` ... (for ``still``
    images one PNG/GIF each, else as :func:`write_video` does), the captioned grid and ``index.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    captions = list(captions)
    clips = [to_pixels(video) for video in videos]
    stems = [directory / f"sample-{index:03d}" for index in range(len(clips))]
    if still:
        files = [_write_still(clip, stem.with_suffix(f".{fmt}")) for clip, stem in zip(clips, stems, strict=True)]
    else:
        files = [_write_frames(clip, stem, fmt, FPS) for clip, stem in zip(clips, stems, strict=True)]
    grid = _write_grid(captioned_grid(clips, captions), directory / ("grid.png" if still else "grid.gif"))
    index = directory / INDEX
    rows = [{"file": file.name, "caption": text, "seed": settings.seed, "steps": settings.steps,
             "guidance": settings.guidance, "sampler": settings.sampler}
            for file, text in zip(files, captions, strict=True)]
    index.write_text(json.dumps(rows, indent=1) + "\n")
    return Gallery(files, captions, clips, still, grid, index)


def _write_still(clip: np.ndarray, path: Path) -> Path:
    from PIL import Image

    Image.fromarray(clip[0]).save(path)
    return path


def _write_grid(frames: np.ndarray, path: Path) -> Path:
    return _write_still(frames, path) if path.suffix == ".png" else _write_frames(frames, path, "gif", FPS)


def grid_shape(count: int) -> tuple[int, int]:
    """``(rows, columns)`` of the grid of ``count`` tiles: as square as possible, filled row by row."""
    columns = max(1, math.ceil(math.sqrt(count)))
    return math.ceil(count / columns), columns


def captioned_grid(clips: Sequence[np.ndarray], captions: Sequence[str]) -> np.ndarray:
    """Tile ``uint8`` clips ``(T, H, W, 3)`` (all of one size) into grid frames ``(T, rows * (H + strip) +
    (rows - 1) * GUTTER, columns * (W + GUTTER) - GUTTER, 3)``, each tile's caption written under it in Pillow's
    default font (wrapped to the tile's width, at most ``CAPTION_LINES`` lines); a clip shorter than the longest
    holds its last frame."""
    from PIL import Image, ImageDraw, ImageFont

    if not clips or len(clips) != len(captions):
        raise ValueError(f"a grid needs one caption per clip, got {len(clips)} clips and {len(captions)} captions")
    font = ImageFont.load_default()
    height, width = clips[0].shape[1:3]
    line_height = font.getbbox("Ag")[3] + 2
    strip = CAPTION_LINES * line_height + 4
    rows, columns = grid_shape(len(clips))
    step_down, step_across = height + strip + GUTTER, width + GUTTER
    canvas = Image.new("RGB", (columns * step_across - GUTTER, rows * step_down - GUTTER), GRID_BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for number, text in enumerate(captions):
        top, left = number // columns * step_down, number % columns * step_across
        draw.rectangle((left, top + height, left + width - 1, top + height + strip - 1), fill=CAPTION_BACKGROUND)
        for line_number, line in enumerate(wrap_caption(text, font, width - 4)):
            draw.text((left + 2, top + height + 2 + line_number * line_height), line, font=font, fill=CAPTION_TEXT)
    length = max(len(clip) for clip in clips)
    frames = np.repeat(np.asarray(canvas)[None], length, axis=0)
    for number, clip in enumerate(clips):
        top, left = number // columns * step_down, number % columns * step_across
        held = np.concatenate([clip, np.repeat(clip[-1:], length - len(clip), axis=0)])
        frames[:, top:top + height, left:left + width] = held
    return frames


def wrap_caption(text: str, font, width: int, lines: int = CAPTION_LINES) -> list[str]:
    """``text`` broken into at most ``lines`` lines of at most ``width`` pixels in ``font``: at spaces, inside a
    word only when the word alone is too wide; what does not fit ends the last line as "..."."""
    wrapped: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
            continue
        if current:
            wrapped.append(current)
        while len(word) > 1 and font.getlength(word) > width:
            cut = next((n for n in range(len(word) - 1, 0, -1) if font.getlength(word[:n]) <= width), 1)
            wrapped.append(word[:cut])
            word = word[cut:]
        current = word
    if current:
        wrapped.append(current)
    if len(wrapped) <= lines:
        return wrapped
    last = wrapped[lines - 1]
    while last and font.getlength(f"{last}...") > width:
        last = last[:-1].rstrip()
    return [*wrapped[:lines - 1], f"{last}..."]
