"""Writing sampled videos where a person can look at them: looping GIFs (Pillow), MP4 (PyAV, H.264), PNG frames.

Videos are ``(3, T, H, W)`` tensors in [-1, 1]; small ones are enlarged with nearest-neighbour so pixels stay crisp.
"""

from __future__ import annotations

from pathlib import Path

import torch
from loongforge.errors import ConfigError

FORMATS = ("gif", "mp4", "png")


def to_frames(video: torch.Tensor, scale: int) -> list:
    """PIL images of each frame, enlarged ``scale`` times."""
    from PIL import Image

    pixels = ((video.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    frames = []
    for frame in pixels.unbind(1):
        image = Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy())
        frames.append(image.resize((image.width * scale, image.height * scale), Image.NEAREST))
    return frames


def write_video(video: torch.Tensor, stem: Path, fmt: str = "gif", *, fps: int = 4, scale: int = 8) -> Path:
    """Write one video as ``stem.gif``, ``stem.mp4`` or ``stem/frame-000.png ...``; return the path written."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown sample format '{fmt}'; use one of {', '.join(FORMATS)}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    frames = to_frames(video, scale)
    if fmt == "gif":
        path = stem.with_suffix(".gif")
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=1000 // fps, loop=0)
        return path
    if fmt == "png":
        stem.mkdir(exist_ok=True)
        for index, frame in enumerate(frames):
            frame.save(stem / f"frame-{index:03d}.png")
        return stem
    return _write_mp4(frames, stem.with_suffix(".mp4"), fps)


def _write_mp4(frames: list, path: Path, fps: int) -> Path:
    try:
        import av
    except ImportError:
        raise ConfigError("mp4 output needs PyAV: pip install 'loongforge-diffusion[video]' (or use gif)") from None
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        # H.264 with yuv420p wants even sides.
        stream.width, stream.height = frames[0].width // 2 * 2, frames[0].height // 2 * 2
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            array = np.asarray(frame)[: stream.height, : stream.width]
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
