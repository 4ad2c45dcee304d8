"""``loongforge train`` for Wan DiTs: the core trainer's task (``loongforge.tasks``) over :class:`DiffusionTask`.

A run config names a Wan flavor (``model: wan-tiny``) and puts the diffusion options under ``task:``::

    task:
      data: null              # a dataset written by `python -m loongforge_diffusion.data.moving_squares`, or
      samples: 2048           #   moving squares generated on the fly: how many, and their geometry
      frames: 4
      side: 16
      speed: 2
      data_seed: 0
      context_dropout: 0.1    # caption dropout, which classifier-free guidance needs
      flow_matching: {shift: 1.0, sampling: uniform, weighting: none}
      sample: {videos: 16, steps: 20, guidance: 3.0, seed: 0}   # after training; videos: 0 skips it

After training the task samples videos for held-out captions, writes them as GIFs to ``<output_dir>/samples``
and, for moving squares, scores them with :mod:`loongforge_diffusion.scoring` (colour, direction, square-ness).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import ConfigError

from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares
from loongforge_diffusion.flow_matching import FlowMatchingConfig
from loongforge_diffusion.scoring import score_videos
from loongforge_diffusion.task import DiffusionTask
from loongforge_diffusion.wan.flavors import WanFlavor

#: ``task:`` keys and their defaults.
OPTIONS: dict[str, Any] = {
    "data": None, "samples": 2048, "frames": 4, "side": 16, "speed": 2, "data_seed": 0, "context_dropout": 0.1,
    "flow_matching": {}, "sample": {},
}
SAMPLE_OPTIONS: dict[str, Any] = {"videos": 16, "steps": 20, "guidance": 3.0, "seed": 0}


def _checked(options: dict[str, Any], known: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return {**known, **options}


class WanRunTask:
    """Flow-matching training of one Wan flavor on the configured data; see the module docstring."""

    def __init__(self, flavor: WanFlavor, config: Any) -> None:
        where = f"task in {config.source}"
        self.options = _checked(dict(config.task), OPTIONS, where)
        self.sample_options = _checked(dict(self.options["sample"]), SAMPLE_OPTIONS, f"task.sample in {config.source}")
        fm_keys = {f.name: None for f in fields(FlowMatchingConfig)}
        fm = _checked(dict(self.options["flow_matching"]), fm_keys, f"task.flow_matching in {config.source}")
        objective = FlowMatchingConfig(**{k: v for k, v in fm.items() if v is not None})
        self.flavor = flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor
        self.geometry = Geometry(self.options["frames"], self.options["side"], self.options["speed"])
        self.task = DiffusionTask(objective=objective, context_dropout=float(self.options["context_dropout"]),
                                  seed=config.run.seed)

    def build_model(self) -> torch.nn.Module:
        return self.task.build_model(self.flavor)

    def build_dataset(self) -> Any:
        opts = self.options
        return self.task.build_dataset(opts["data"], length=opts["samples"], text_dim=self.flavor.text_dim,
                                       seed=opts["data_seed"], frames=self.geometry.frames, side=self.geometry.side,
                                       speed=self.geometry.speed)

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.task.training_step(model, batch)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.task.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task.generator.set_state(state["generator"])

    def finish(self, model: torch.nn.Module, output_dir: Path) -> dict[str, Any]:
        """Sample held-out captions (a data seed never trained on), write GIFs, score them."""
        opts = self.sample_options
        if opts["videos"] <= 0:
            return {}
        held_out = MovingSquares(opts["videos"], text_dim=self.flavor.text_dim, seed=self.options["data_seed"] + 7919,
                                 geometry=self.geometry)
        items = [held_out[i] for i in range(len(held_out))]
        context = torch.stack([item["context"] for item in items])
        labels = torch.stack([item["labels"] for item in items])
        shape = (len(items), *items[0]["video"].shape)
        videos = self.task.sample(model, {"context": context}, opts["steps"], shape=shape,
                                  guidance=float(opts["guidance"]), seed=int(opts["seed"]))
        directory = write_gifs(videos, Path(output_dir) / "samples")
        scores = score_videos(videos, labels) if self.options["data"] is None else {}
        return {"samples_dir": str(directory), "sample_scores": scores}


def write_gifs(videos: torch.Tensor, directory: Path, *, scale: int = 8, frame_ms: int = 250) -> Path:
    """Write ``(B, 3, T, H, W)`` videos in [-1, 1] as looping GIFs ``sample-<i>.gif``, enlarged ``scale`` times."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    pixels = ((videos.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    for index, video in enumerate(pixels):
        frames = [Image.fromarray(frame.permute(1, 2, 0).numpy()).resize(
            (frame.shape[2] * scale, frame.shape[1] * scale), Image.NEAREST) for frame in video.unbind(1)]
        frames[0].save(directory / f"sample-{index:03d}.gif", save_all=True, append_images=frames[1:],
                       duration=frame_ms, loop=0)
    return directory
