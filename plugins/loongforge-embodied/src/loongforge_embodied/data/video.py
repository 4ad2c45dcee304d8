"""Video frames in and out of mp4 files with PyAV: encode episodes (H.264 or AV1) and decode frames by timestamp.

LeRobot stores camera streams as mp4 videos and addresses a frame by its timestamp, not its position: a
dataset row says "episode 3, t = 1.2 s" and the reader must find the frame shown at that time. Decoding
therefore seeks to the key frame before the earliest wanted time and decodes forward, keeping the frame
closest to each wanted time. PyAV is used because it is the one decoder that works beside CPU torch here
(torchvision's video ops do not import, torchcodec needs a system FFmpeg), and it decodes AV1 (LeRobot's
default codec since v2.1) as well as H.264.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import av
import numpy as np

from loongforge_embodied.data.lerobot_format import one_line

#: Codec names used in LeRobot's ``info.json`` (``video.codec``) -> the PyAV encoder that writes them.
ENCODERS = {"h264": "libx264", "av1": "libsvtav1"}


class FrameLookupError(LookupError):
    """No decoded frame lies within the tolerance of a wanted timestamp."""


class VideoFileError(ValueError):
    """A video file that cannot be opened or decoded: missing, truncated, corrupt, or without a video stream."""


def encode_video(
    path: str | Path, frames: np.ndarray, fps: int, *, codec: str = "h264", crf: int = 10, gop: int = 2
) -> None:
    """Write ``frames`` (T, H, W, 3) uint8 RGB as an mp4 with one frame every ``1/fps`` s, starting at t = 0.

    ``gop`` is the key-frame interval: LeRobot uses 2 so that a random-access read decodes at most one extra
    frame. ``crf`` trades size for fidelity (lower is closer; H.264 ``0`` is lossless in YUV, the RGB<->YUV 4:2:0
    conversion still rounds).
    """
    if codec not in ENCODERS:
        raise ValueError(f"video codec '{codec}' is not supported for writing; choose one of {sorted(ENCODERS)}")
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be (T, H, W, 3) uint8 RGB, got {frames.shape} {frames.dtype}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(ENCODERS[codec], rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "g": str(gop)}
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())


def decode_frames(
    container: av.container.InputContainer, timestamps: Sequence[float], *, tolerance_s: float = 1e-4
) -> np.ndarray:
    """The frames shown at ``timestamps`` (seconds) as (K, H, W, 3) uint8 RGB, in the order asked.

    One seek (to the key frame at or before the earliest time) and one forward decode serve all the times,
    so a window of nearby frames costs little more than one frame. Raises :class:`FrameLookupError` when the
    closest decoded frame is further than ``tolerance_s`` from a wanted time (a video shorter than its
    episode, or timestamps that are not multiples of ``1/fps``), :class:`VideoFileError` when the stream does not
    decode.
    """
    stream = container.streams.video[0]
    wanted = np.asarray(timestamps, dtype=np.float64)
    first, last = float(wanted.min()), float(wanted.max())
    best: list[av.VideoFrame | None] = [None] * len(wanted)
    best_gap = np.full(len(wanted), np.inf)
    try:
        container.seek(max(0, int(first / stream.time_base)), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            gaps = np.abs(wanted - frame.time)
            closer = gaps < best_gap
            for k in np.flatnonzero(closer):
                best[k] = frame
            best_gap = np.minimum(best_gap, gaps)
            if frame.time > last + tolerance_s:
                break
    except (av.error.FFmpegError, OSError) as err:
        raise VideoFileError(f"cannot decode ({one_line(err)})") from None
    worst = int(np.argmax(best_gap))
    if best_gap[worst] > tolerance_s:
        found = "no frame" if best[worst] is None else f"closest frame at {best[worst].time:.4f} s"
        raise FrameLookupError(f"no frame within {tolerance_s} s of t={wanted[worst]:.4f} s ({found})")
    # One swscale thread: PyAV keeps a converter per thread whose slice threads a forked DataLoader worker inherits
    # without the threads themselves, so a worker forked after the parent converted a frame waited forever; the
    # decoding is spread over our prefetch threads or worker processes already.
    return np.stack([frame.to_ndarray(format="rgb24", threads=1) for frame in best])


def open_video(path: str | Path) -> av.container.InputContainer:
    """``path`` opened for decoding; :class:`VideoFileError` when it is not a readable video (a missing or truncated
    file, garbage, an mp4 without a video stream) -- PyAV's own errors name neither the file nor the problem."""
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as err:
        raise VideoFileError(f"not a readable video ({one_line(err)})") from None
    if not container.streams.video:
        container.close()
        raise VideoFileError("holds no video stream")
    return container


class ContainerCache:
    """Open video containers kept per thread, least recently used closed first.

    Opening an mp4 reads its index, so reusing the container across items saves most of the cost of a
    random-access read. A PyAV container is not safe to share between threads, so each thread (a prefetch
    thread, or the thread of a DataLoader worker process) keeps its own. Nor between processes: a forked
    DataLoader worker inherits the parent thread's containers, whose file offsets it would share with the
    parent and its sibling workers, so a process that did not open a container never uses it. Nothing open
    is pickled: a copy sent to a spawned worker starts empty.
    """

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._local = threading.local()

    def get(self, path: str | Path) -> av.container.InputContainer:
        """The open container for ``path`` in this thread, opened on first use (:func:`open_video`)."""
        opened: OrderedDict[str, av.container.InputContainer] = self._opened()
        key = str(path)
        if key in opened:
            opened.move_to_end(key)
            return opened[key]
        container = open_video(key)
        opened[key] = container
        while len(opened) > self.capacity:
            opened.popitem(last=False)[1].close()
        return container

    def close(self) -> None:
        """Close this thread's containers."""
        opened = self._opened()
        while opened:
            opened.popitem()[1].close()

    def _opened(self) -> OrderedDict:
        if getattr(self._local, "pid", None) != os.getpid():
            self._local.opened, self._local.pid = OrderedDict(), os.getpid()
        return self._local.opened

    def __getstate__(self) -> dict:
        return {"capacity": self.capacity}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["capacity"])
