"""The ``tensorboard`` tracker: event files in ``<output_dir>/tensorboard`` (``tensorboard --logdir`` that folder).

Scalars are ``<group>/<name>``; the resolved config goes to the HParams dashboard and, as a readable table, to the
Text dashboard (``config``). Each picture is its own tag, ``<tag>/<index>``, with its caption as a text summary of
the same tag; videos are animated GIFs written as image summaries, which TensorBoard's image panel plays (its own
``add_video`` needs moviepy, which a training run should not depend on). Pictures need Pillow, which the plugins
that make pictures install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.train.media import gif_bytes
from loongforge.train.trackers import Scalar, Tracker

if TYPE_CHECKING:
    import numpy as np

    from loongforge.config.schema import LoggingConfig


class TensorBoardTracker(Tracker):
    def __init__(self, output_dir: Path, logging: LoggingConfig, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = output_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self.location = f"tensorboard --logdir {self.log_dir}"

    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"{group}/{name}", value, step)

    def hparams(self, params: Mapping[str, Scalar]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(dict(params), {}):  # experiment, session start, session end: the HParams dashboard
            self._writer.file_writer.add_summary(summary)
        table = "\n".join(["| key | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in params.items())])
        self._writer.add_text("config", table, 0)

    def images(self, tag: str, images: Sequence[np.ndarray], captions: Sequence[str], *, step: int) -> None:
        for index, (image, caption) in enumerate(zip(images, captions, strict=True)):
            self._writer.add_image(f"{tag}/{index}", image, step, dataformats="HWC")
            self._writer.add_text(f"{tag}/{index}", caption, step)

    def videos(self, tag: str, videos: Sequence[np.ndarray], captions: Sequence[str], *, step: int,
               fps: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        for index, (video, caption) in enumerate(zip(videos, captions, strict=True)):
            _, height, width, channels = video.shape
            gif = Summary.Image(height=height, width=width, colorspace=1 if channels == 1 else 3,
                                encoded_image_string=gif_bytes(video, fps))
            self._writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=f"{tag}/{index}", image=gif)]),
                                                 step)
            self._writer.add_text(f"{tag}/{index}", caption, step)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}",
                 *(f"| {' | '.join(cell(v) for v in row)} |" for row in rows)]
        self._writer.add_text(tag, "\n".join(lines), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
