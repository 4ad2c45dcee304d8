"""Pictures a run logs next to its scalars: the contract between what makes them (a task's ``finish``, e.g. a
diffusion model's end-of-run samples) and the experiment trackers that show them (``logging.trackers``).

Why a protocol rather than a tracker object: a task should not care whether TensorBoard, W&B, MLflow or nothing
is listening, so it gets one :class:`MediaLog` and calls it with plain ``uint8`` arrays; each tracker encodes them
its own way. Images are ``H x W x C`` (C = 1, 3 or 4), videos ``T x H x W x C``, both ``numpy.uint8``; every
picture comes with its caption (the prompt it was sampled from, the episode it shows). Torch-free.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, Protocol


class MediaLog(Protocol):
    """Where a run's pictures go (every tracker of ``logging.trackers`` that can show them)."""

    def images(self, tag: str, images: Sequence[Any], captions: Sequence[str], *, step: int) -> None:
        """Log ``images`` (``uint8`` H x W x C arrays) under ``tag``, each with its caption."""

    def videos(self, tag: str, videos: Sequence[Any], captions: Sequence[str], *, step: int, fps: int) -> None:
        """Log ``videos`` (``uint8`` T x H x W x C arrays, played at ``fps``) under ``tag``, each with its caption."""

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        """Log a table of text and numbers (``rows``, each with one value per column) under ``tag``."""


class NoMediaLog:
    """A :class:`MediaLog` that drops everything (ranks other than 0, runs with no tracker that shows pictures)."""

    def images(self, tag: str, images: Sequence[Any], captions: Sequence[str], *, step: int) -> None:
        return None

    def videos(self, tag: str, videos: Sequence[Any], captions: Sequence[str], *, step: int, fps: int) -> None:
        return None

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        return None


def gif_bytes(video: Any, fps: int) -> bytes:
    """A ``uint8`` T x H x W x C video as an endlessly looping animated GIF, encoded with Pillow (no video codec or
    moviepy needed): what TensorBoard's image panel plays, what W&B and MLflow show, and the one GIF encoder the
    plugins write their sample and rollout files with. Pillow picks a 256-colour palette per frame; a frame delay
    is whole milliseconds, at least one."""
    from PIL import Image

    frames = [Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame[..., :3]) for frame in video]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=max(1, round(1000 / fps)),
                   loop=0)
    return buffer.getvalue()
