"""The ``wandb`` tracker (extra ``loongforge-core[wandb]``): a W&B run in ``<output_dir>/wandb``.

Offline by default (``logging.wandb_mode``): W&B writes ``offline-run-*/run-*.wandb`` and nothing goes over the
network until ``wandb sync`` uploads it. The resolved config is the run's ``config``; pictures are
``wandb.Image`` / ``wandb.Video`` with their captions. Videos are handed over as GIF files written next to the
run (``wandb.Video`` would need moviepy to encode raw frames). W&B's console capture is off: the run's own output
already goes to the terminal and the log files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.train.media import gif_bytes
from loongforge.train.trackers import Scalar, Tracker, rgb

if TYPE_CHECKING:
    import numpy as np

    from loongforge.config.schema import LoggingConfig


class WandbTracker(Tracker):
    def __init__(self, output_dir: Path, logging: LoggingConfig, *, start_step: int) -> None:
        import wandb

        self._wandb = wandb
        self.dir = output_dir / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=logging.wandb_project, dir=str(output_dir), mode=logging.wandb_mode,
                               name=output_dir.name, settings=wandb.Settings(silent=True, console="off"))
        run_dir = Path(self._run.dir).parent  # wandb/offline-run-<time>-<id> (``dir`` is its files/ folder)
        self.location = (f"{run_dir} (upload: wandb sync {run_dir})" if logging.wandb_mode == "offline"
                         else str(self._run.url))

    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        self._run.log({f"{group}/{name}": value for name, value in values.items()}, step=step)

    def hparams(self, params: Mapping[str, Scalar]) -> None:
        self._run.config.update(dict(params))

    def images(self, tag: str, images: Sequence[np.ndarray], captions: Sequence[str], *, step: int) -> None:
        shown = [self._wandb.Image(rgb(image), caption=caption)
                 for image, caption in zip(images, captions, strict=True)]
        self._run.log({tag: shown}, step=step)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        self._run.log({tag: self._wandb.Table(columns=list(columns), data=[list(row) for row in rows])}, step=step)

    def videos(self, tag: str, videos: Sequence[np.ndarray], captions: Sequence[str], *, step: int,
               fps: int) -> None:
        folder = self.dir / "videos" / tag.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        shown = []
        for index, (video, caption) in enumerate(zip(videos, captions, strict=True)):
            path = folder / f"step{step:06d}-{index:03d}.gif"
            path.write_bytes(gif_bytes(video, fps))
            shown.append(self._wandb.Video(str(path), caption=caption, format="gif"))
        self._run.log({tag: shown}, step=step)

    def flush(self) -> None:
        return None  # the W&B service process writes the run file as records arrive

    def close(self) -> None:
        self._run.finish()
