"""A record's video -> the frames a Qwen processor reads, with their times: decoding and frame sampling.

A video is given three ways (see :mod:`loongforge_vlm.data.records`): a list of frame files (taken at the record's
``fps``), a directory of frame files (the same, in name order), or one video file -- a GIF (decoded with Pillow,
its rate from the frame durations) or an mp4/webm/mkv/mov/avi clip (decoded with PyAV, when it is installed).
Frames are then sampled the way the tower's own processor samples them, so a model sees the frame rate and the
frame times it was trained with:

* ``num_frames`` (a fixed count, rounded to whole temporal patches) or else ``fps`` frames per second, at least
  ``min_frames`` and at most ``max_frames`` (transformers' ``Qwen2VLVideoProcessor.sample_frames``: indices
  ``arange(0, total, total / n)`` truncated; Qwen3-VL's: ``linspace(0, total - 1, n)`` rounded, ``n`` not
  rounded). A frame list or directory is all the frames there are: ``fps`` is their rate, not a sampling rate.
* the times: Qwen2.5-VL's M-RoPE reads ``second_per_grid_ts`` (seconds one temporal patch spans), Qwen3-VL's text
  reads each temporal patch's mean frame time (``<1.5 seconds>``, transformers' ``_calculate_timestamps``).

Decoding a whole clip to sample from it is simple and fine for the short clips of VLM training; long videos are
better cut into clips beforehand.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageSequence

#: File name endings read as a video clip through PyAV (GIFs go through Pillow).
CLIP_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi")
DEFAULT_FPS = 2.0


class VideoError(ValueError):
    """A video that cannot be read or sampled; ``where`` names it, ``reason`` says why."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


@dataclass(frozen=True)
class FrameSampling:
    """How frames are taken from a video file: ``fps`` per second or exactly ``num_frames``; ``rule`` is the
    tower's (``qwen2``: Qwen2-VL / Qwen2.5-VL, ``qwen3``: Qwen3-VL)."""

    fps: float = DEFAULT_FPS
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    rule: str = "qwen2"

    def __post_init__(self) -> None:
        if not self.fps > 0 or (self.num_frames is not None and self.num_frames < 1):
            raise ValueError(f"need fps > 0 and num_frames >= 1, got fps={self.fps}, num_frames={self.num_frames}")
        if self.rule not in ("qwen2", "qwen3"):
            raise ValueError(f"unknown frame sampling rule {self.rule!r}; known: qwen2, qwen3")


def sample_indices(total: int, source_fps: float, sampling: FrameSampling, temporal_patch_size: int) -> list[int]:
    """Indices of the frames to keep out of ``total`` frames recorded at ``source_fps``."""
    tp = temporal_patch_size
    if sampling.rule == "qwen3":
        count = sampling.num_frames
        if count is None:
            count = min(max(int(total / source_fps * sampling.fps), sampling.min_frames), sampling.max_frames, total)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()
    if sampling.num_frames is not None:
        count = round(sampling.num_frames / tp) * tp
    else:
        most = math.floor(min(sampling.max_frames, total) / tp) * tp
        count = min(max(total / source_fps * sampling.fps, sampling.min_frames), most, total)
        count = math.floor(count / tp) * tp
    if not 0 < count <= total:
        raise ValueError(f"has {total} frame(s), too few to sample {max(count, tp)} (whole temporal patches of {tp})")
    return np.arange(0, total, total / count).astype(np.int32)[:count].tolist()


def patch_times(indices: Sequence[int], source_fps: float, temporal_patch_size: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the last frame repeats to
    fill the final patch, as the processor pads it)."""
    seconds = [i / source_fps for i in indices]
    seconds += [seconds[-1]] * (-len(seconds) % temporal_patch_size)
    tp = temporal_patch_size
    return [(seconds[k] + seconds[k + tp - 1]) / 2 for k in range(0, len(seconds), tp)]


@dataclass(frozen=True)
class SampledVideo:
    """The kept frames, where they came from, and the seconds one temporal patch spans / each patch's time."""

    frames: list[Image.Image]
    where: str
    seconds_per_patch: float
    times: list[float]


def decode_clip(where: str, data: bytes) -> tuple[list[Image.Image], float | None]:
    """All frames of a GIF (Pillow) or a video clip (PyAV) and its frame rate (``None`` when it states none)."""
    if where.lower().endswith(".gif"):
        try:
            gif = Image.open(io.BytesIO(data))
            frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
        except Exception as exc:  # Pillow raises many types for a damaged file
            raise VideoError(where, f"cannot be decoded as a GIF ({type(exc).__name__})") from None
        duration = gif.info.get("duration") or 0
        return frames, 1000.0 / duration if duration > 0 else None
    try:
        import av
    except ImportError:
        raise VideoError(where, "is a video clip, and reading clips needs PyAV (pip install av); or give the video "
                                "as a GIF or a list/directory of frames") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None
            frames = [frame.to_image() for frame in container.decode(stream)]
    except Exception as exc:  # PyAV's errors for unreadable input are many
        raise VideoError(where, f"cannot be decoded as a video ({type(exc).__name__})") from None
    return frames, rate


def load_video(video: str | Sequence[str], read: Callable[[str], tuple[str, bytes]],
               decode_frame: Callable[[str], tuple[str, Image.Image]], listing: Callable[[str], list[str] | None],
               sampling: FrameSampling, temporal_patch_size: int) -> SampledVideo:
    """Decode and sample one video. ``read(name)`` gives a file's location and bytes, ``decode_frame(name)`` a frame
    file's location and image, ``listing(name)`` a directory's frame names (``None``: not a directory). Raises
    :class:`VideoError` naming the video for what cannot be a video."""
    tp = temporal_patch_size
    if isinstance(video, str) and video.lower().endswith((".gif", *CLIP_EXTENSIONS)):
        where, data = read(video)
        frames, rate = decode_clip(where, data)
        rate = rate or sampling.fps
        try:
            indices = sample_indices(len(frames), rate, sampling, tp)
        except ValueError as exc:
            raise VideoError(where, str(exc)) from None
        frames = [frames[i] for i in indices]
    else:
        names = listing(video) if isinstance(video, str) else list(video)
        if names is None:
            raise VideoError(str(video), f"is neither a video file ({', '.join(('.gif', *CLIP_EXTENSIONS))}) nor a "
                                         "directory of frames")
        indices = list(range(len(names)))
        if sampling.num_frames is not None and sampling.num_frames < len(names):
            indices = sample_indices(len(names), sampling.fps, sampling, tp)
        decoded = [decode_frame(names[i]) for i in indices]
        where = str(video) if isinstance(video, str) else decoded[0][0] if decoded else "video"
        frames, rate = [image for _, image in decoded], sampling.fps
        sizes = {frame.size for frame in frames}
        if len(sizes) > 1:
            raise VideoError(decoded[0][0], f"video frames differ in size: {sorted(sizes)}")
    if len(frames) < tp:
        raise VideoError(where, f"has {len(frames)} frame(s); a video needs at least {tp} (one temporal patch): "
                                "give a single frame as an image")
    spacing = (indices[-1] - indices[0]) / (len(indices) - 1) if len(indices) > 1 else 1.0
    return SampledVideo(frames, where, tp * spacing / rate, patch_times(indices, rate, tp))
