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
``loongforge sample CHECKPOINT --prompt "a red square of size 4 moving right"`` samples new captions later.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import ConfigError

from loongforge_diffusion.data.moving_squares import (
    Geometry,
    MovingSquares,
    caption_tokens,
    embedding_table,
    parse_caption,
)
from loongforge_diffusion.flow_matching import FlowMatchingConfig
from loongforge_diffusion.media import write_video
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
        #: Training steps taken (with the sample index, it seeds each sample's noise).
        self.steps = 0

    def build_model(self) -> torch.nn.Module:
        return self.task.build_model(self.flavor)

    def build_dataset(self) -> Any:
        opts = self.options
        return self.task.build_dataset(opts["data"], length=opts["samples"], text_dim=self.flavor.text_dim,
                                       seed=opts["data_seed"], frames=self.geometry.frames, side=self.geometry.side,
                                       speed=self.geometry.speed)

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss with noise drawn per sample from (seed, step, dataset index): the same draws on
        one process or spread over data-parallel ranks, so every layout trains the same run."""
        self.steps += 1
        generators = [torch.Generator().manual_seed(_sample_seed(self.task.seed, self.steps, int(i)))
                      for i in batch["index"].tolist()]
        return self.task.training_step(model, batch, generators)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

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
        directory = Path(output_dir) / "samples"
        for index, video in enumerate(videos):
            write_video(video, directory / f"sample-{index:03d}")
        scores = score_videos(videos, labels) if self.options["data"] is None else {}
        return {"samples_dir": str(directory), "sample_scores": scores}

    def sample_files(self, model: torch.nn.Module, prompts: list[str], out_dir: Path, *, steps: int, guidance: float,
                     seed: int, fmt: str) -> list[Path]:
        """``loongforge sample``: one video per moving-squares caption (``"a red square of size 4 moving right"``)."""
        if self.options["data"] is not None:
            raise ConfigError("sampling from prompts needs the captions' text encoder; this run trained on a "
                              "written dataset of precomputed caption states")
        try:
            labels = torch.stack([parse_caption(prompt) for prompt in prompts])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        context = embedding_table(self.flavor.text_dim)[caption_tokens(labels)]
        geometry = self.geometry
        shape = (len(prompts), 3, geometry.frames, geometry.side, geometry.side)
        videos = self.task.sample(model, {"context": context}, steps, shape=shape, guidance=guidance, seed=seed)
        return [write_video(video, Path(out_dir) / f"sample-{index:03d}", fmt) for index, video in enumerate(videos)]


def _sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for one sample's draws at one step, well mixed so neighbouring seeds share nothing."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
