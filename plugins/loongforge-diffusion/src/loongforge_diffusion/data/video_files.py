"""Captioned videos on disk, read as ``(3, T, H, W)`` tensors in [-1, 1] at one fixed size.

The input of the latent cache (:mod:`loongforge_diffusion.data.latents`), in one of three forms:

- a JSON-lines file of ``{"video": "clip.mp4" | "frames_dir/", "caption": "..."}`` (paths relative to the file);
  MP4 (and anything else FFmpeg reads) is decoded with PyAV, a frames directory is its images in name order;
- a directory of videos (``*.mp4`` files or frame directories), each captioned by a sibling ``<name>.txt``;
- a moving-squares ``.pt`` file (``loongforge make-data moving-squares``), captioned by
  :func:`~loongforge_diffusion.data.moving_squares.caption` -- a self-contained input for tests and tutorials.

Clips are listed up front (cheap) and decoded one at a time when encoded, so memory holds one batch of pixels.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from loongforge.data.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi")


@dataclass(frozen=True)
class Clip:
    """One captioned video: ``source`` names it in messages, ``load()`` returns its pixels ``(3, T, H, W)``."""

    source: str
    caption: str
    load: Callable[[], torch.Tensor]


def list_clips(path: str | Path) -> list[Clip]:
    """The captioned videos of a ``.jsonl`` file, a directory or a moving-squares ``.pt`` file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or directory (expected a .jsonl, a directory of videos or a .pt file)")
    if path.is_dir():
        return _directory_clips(path)
    if path.suffix == ".jsonl":
        return _jsonl_clips(path)
    if path.suffix == ".pt":
        return _moving_squares_clips(path)
    raise DataError(f"{path}: unsupported input; use a .jsonl of {{video, caption}}, a directory or a .pt file")


def _jsonl_clips(path: Path) -> list[Clip]:
    clips = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            video, text = row["video"], row["caption"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{number}: expected {{\"video\": PATH, \"caption\": TEXT}} ({exc})") from None
        clips.append(_file_clip(path.parent / video, str(text), f"{path}:{number}"))
    if not clips:
        raise DataError(f"{path}: no videos listed")
    return clips


def _directory_clips(path: Path) -> list[Clip]:
    entries = sorted(p for p in path.iterdir() if p.is_dir() or p.suffix.lower() in VIDEO_SUFFIXES)
    if not entries:
        raise DataError(f"{path}: no videos ({', '.join(VIDEO_SUFFIXES)} files or frame directories) found")
    clips = []
    for entry in entries:
        caption_file = entry.with_suffix(".txt") if entry.is_file() else entry.parent / f"{entry.name}.txt"
        if not caption_file.is_file():
            raise DataError(f"{entry}: no caption file {caption_file.name} beside it")
        clips.append(_file_clip(entry, caption_file.read_text().strip(), str(entry)))
    return clips


def _file_clip(video: Path, text: str, where: str) -> Clip:
    if not video.exists():
        raise DataError(f"{where}: video {video} does not exist")
    reader = read_frames_dir if video.is_dir() else read_video_file
    return Clip(where, text, lambda: reader(video))


def _moving_squares_clips(path: Path) -> list[Clip]:
    from loongforge_diffusion.data.moving_squares import TensorVideoDataset, caption

    try:
        dataset = TensorVideoDataset(path)
    except (RuntimeError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a moving-squares dataset ({exc})") from None
    return [Clip(f"{path}[{i}]", caption(dataset.tensors["labels"][i]),
                 lambda i=i: dataset.tensors["video"][i].float()) for i in range(len(dataset))]


def _to_unit_range(frames: torch.Tensor) -> torch.Tensor:
    """``(T, H, W, 3)`` uint8 -> ``(3, T, H, W)`` float in [-1, 1]."""
    return frames.permute(3, 0, 1, 2).float() / 127.5 - 1.0


def read_video_file(path: Path) -> torch.Tensor:
    """Every frame of a video file, decoded with PyAV."""
    try:
        import av
    except ImportError:
        raise DataError(f"{path}: decoding video files needs PyAV: pip install av") from None
    try:
        with av.open(str(path)) as container:
            # one swscale thread: PyAV's per-thread converter would hand a forked DataLoader worker slice threads
            # that do not exist in it (a hang)
            frames = [torch.from_numpy(f.to_ndarray(format="rgb24", threads=1)) for f in container.decode(video=0)]
    except (av.error.FFmpegError, IndexError) as exc:
        raise DataError(f"{path}: cannot decode the video ({exc})") from None
    if not frames:
        raise DataError(f"{path}: the video has no frames")
    return _to_unit_range(torch.stack(frames))


def read_frames_dir(path: Path) -> torch.Tensor:
    """The images of a directory, in name order, as the frames of one video."""
    from PIL import Image, UnidentifiedImageError

    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataError(f"{path}: no frame images ({', '.join(IMAGE_SUFFIXES)})")
    frames = []
    for file in files:
        try:
            with Image.open(file) as image:
                frames.append(torch.from_numpy(_rgb_array(image)))
        except (OSError, UnidentifiedImageError) as exc:
            raise DataError(f"{file}: cannot read the frame ({exc})") from None
    if len({f.shape for f in frames}) != 1:
        raise DataError(f"{path}: frames differ in size {sorted({tuple(f.shape[:2]) for f in frames})}")
    return _to_unit_range(torch.stack(frames))


def _rgb_array(image):
    import numpy as np

    return np.array(image.convert("RGB"))


def fit(video: torch.Tensor, frames: int, height: int, width: int, *, source: str) -> torch.Tensor:
    """The first ``frames`` frames, resized to cover ``height x width`` (aspect kept, antialiased bilinear) and
    centre-cropped to it; a video with too few frames is an error rather than silently padded."""
    channels, length, rows, cols = video.shape
    if length < frames:
        raise DataError(f"{source}: {length} frames, fewer than the {frames} requested (--frames)")
    clip = video[:, :frames].float()
    scale = max(height / rows, width / cols)
    size = (max(height, math.ceil(rows * scale - 1e-6)), max(width, math.ceil(cols * scale - 1e-6)))
    if size != (rows, cols):
        resized = F.interpolate(clip.transpose(0, 1), size=size, mode="bilinear", antialias=True, align_corners=False)
        clip = resized.transpose(0, 1)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return clip[:, :, top:top + height, left:left + width].clamp(-1.0, 1.0).contiguous()
