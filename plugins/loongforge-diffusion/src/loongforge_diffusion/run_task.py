"""``loongforge train`` for Wan DiTs: the core trainer's task (``loongforge.tasks``) over :class:`DiffusionTask`.

A run config names a Wan flavor (``model: wan-tiny``) and puts the diffusion options under ``task:``::

    task:
      data: null              # a .pt from `loongforge make-data moving-squares`, a latent cache
                              #   directory (`loongforge cache-latents`), or
      samples: 2048           #   moving squares generated on the fly: how many, and their geometry
      frames: 4
      side: 16
      speed: 2
      data_seed: 0
      context_dropout: 0.1    # caption dropout, which classifier-free guidance needs
      flow_matching: {shift: 1.0, sampling: uniform, weighting: none}
      sample: {videos: 16, steps: 20, guidance: 3.0, seed: 0}   # after training; videos: 0 skips it
      init: null              # weights to start from: a LoongForge checkpoint of this task, or a released Wan
                              #   DiT directory (diffusers or original names)
      lora: null              # {rank: 16, alpha: 16, dropout: 0.0, targets: [self_attn, cross_attn, ffn]}
      ema: null               # {decay: 0.999, warmup: true}: samples use the averaged weights
      recompute: false        # activation checkpointing per block

A flavor with ``expert_boundary`` (Wan 2.2 A14B) trains its two experts in one run
(:mod:`loongforge_diffusion.wan.experts`): each step draws the expert that trains it, with the probability the
objective gives that expert's noise levels, and draws the step's noise levels within them, so a step touches one
expert and each expert sees the noise levels it serves as often as one model would. ``task.ema`` keeps one average
per expert; ``task.init`` is a two-expert checkpoint or a released A14B folder (diffusers' ``transformer/`` +
``transformer_2/``, or ``high_noise_model/`` + ``low_noise_model/``); a ``flow_matching.sigma_range`` on one side of
the boundary trains that expert alone, as Wan-AI's recipe trains each in its own run.

With ``evaluation.interval > 0`` core's loop logs the validation loss: the conditional flow-matching loss (no caption
dropout) of the trained weights on moving squares of the held-out data seed (or on ``evaluation.data``: one written
dataset or latent cache, like ``task.data``), with the same noise and noise levels at every evaluation.

After training the task samples videos for held-out captions (the denoising steps shown as progress), writes
them as GIFs to ``<output_dir>/samples`` with a captioned ``grid.gif`` and ``index.json``
(:func:`loongforge_diffusion.media.write_samples`), sends them with their captions to the run's trackers (tag
``samples``, at the last step) and, for moving squares, scores them with :mod:`loongforge_diffusion.scoring`
(colour, direction, square-ness). ``loongforge sample CHECKPOINT --prompt "a red square of size 4 moving right"``
samples new captions later (the same files, grid and index in ``--out``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loongforge.config.plugin_sections import task_options
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.progress import job_progress
from loongforge.tasks import TaskBase, sample_generators
from loongforge.train.media import MediaLog

from loongforge_diffusion.data.latents import INDEX as LATENT_INDEX
from loongforge_diffusion.data.latents import CachedLatentDataset
from loongforge_diffusion.data.moving_squares import (
    Geometry,
    MovingSquares,
    caption,
    caption_tokens,
    embedding_table,
    parse_caption,
)
from loongforge_diffusion.media import SampleSettings, write_samples
from loongforge_diffusion.options import WanTaskOptions
from loongforge_diffusion.parallel import ContextParallel, context_parallel_step
from loongforge_diffusion.run_options import (
    HELD_OUT_SEED_OFFSET,
    EMAOption,
    ExpertEMA,
    checkpoint_weights,
    load_init,
    no_held_out_data,
)
from loongforge_diffusion.scoring import score_videos
from loongforge_diffusion.task import DiffusionTask
from loongforge_diffusion.training import flavor_of, flow_matching_step
from loongforge_diffusion.wan.checkpoint import load_wan_checkpoint
from loongforge_diffusion.wan.experts import EXPERTS, WanExperts, choose_grouped_expert, expert_state_dict
from loongforge_diffusion.wan.flavors import WanFlavor
from loongforge_diffusion.wan.lora import apply_lora
from loongforge_diffusion.wan.model import WanModel
from loongforge_diffusion.wan.residency import ExpertResidency


class WanRunTask(TaskBase):
    """Flow-matching training of one Wan flavor on the configured data; see the module docstring."""

    context_parallel = True  # Ulysses: use_context_parallel below
    tensor_parallel = True  # DTensor-split blocks under fsdp2: use_tensor_parallel below

    def __init__(self, flavor: WanFlavor, config: Any) -> None:
        self.options: WanTaskOptions = task_options(flavor, config)
        self.sample_options = self.options.sample
        self.flavor = flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor
        self.flavor_name = config.model.name
        self.source = config.source
        try:
            self.geometry = Geometry(self.options.frames, self.options.side, self.options.speed)
        except ValueError as exc:
            raise ConfigError(f"{config.source}: task.frames/side/speed: {exc}") from None
        self.lora = self.options.lora
        #: Wan 2.2 A14B: two experts, one trained per step (the last one in ``trained_expert``).
        self.experts = self.flavor.expert_boundary is not None
        self.trained_expert: str | None = None
        self.ema = ExpertEMA(self.options.ema, EXPERTS) if self.experts else EMAOption(self.options.ema)
        if self.options.experts_resident == "one" and not self.experts:
            raise ConfigError(f"{config.source}: task.experts_resident: one needs a two-expert flavor (one with "
                              f"expert_boundary, Wan 2.2 A14B); '{config.model.name}' is one DiT")
        #: ``task.experts_resident: one``: which expert is on the device (set by ``place_model``).
        self.residency: ExpertResidency | None = None
        self.task = DiffusionTask(objective=self.options.flow_matching, context_dropout=self.options.context_dropout,
                                  seed=config.run.seed)
        #: Training steps taken (with the sample index, it seeds each sample's noise).
        self.steps = 0
        #: Set by ``use_context_parallel`` (``parallel.cp > 1``): the ranks that split each video's tokens.
        self.cp: ContextParallel | None = None

    def use_context_parallel(self, group: Any) -> None:
        """``parallel.cp > 1``: Ulysses context parallelism over ``group`` (core's task loop gives every rank of
        it the same samples); the token count and head count must divide by its size."""
        self.cp = ContextParallel(group)

    def use_tensor_parallel(self, model: torch.nn.Module, mesh: Any) -> None:
        """``parallel.tp > 1``: split the blocks' heads and FFN columns over ``mesh``
        (:mod:`loongforge_diffusion.wan.tensor_parallel`)."""
        from loongforge_diffusion.wan.tensor_parallel import check_tensor_parallel, parallelize_wan

        check_tensor_parallel(self.flavor, mesh.size(), self.cp.size if self.cp is not None else 1, self.source)
        parallelize_wan(model, mesh)

    @property
    def sparse_parameters(self) -> bool:
        """Two experts: each step leaves the other expert's parameters out (see :class:`loongforge.tasks.TaskBase`)."""
        return self.experts

    def bare_model(self) -> torch.nn.Module:
        """The flavor's module before weights and adapters: one :class:`WanModel`, or both experts."""
        build = WanExperts if self.experts else WanModel
        return build(self.flavor, recompute=self.options.recompute)

    def released_weights(self, path: str) -> dict[str, torch.Tensor]:
        """A released Wan DiT directory's weights in our names (both experts' under ``high.``/``low.``)."""
        if self.experts:
            return expert_state_dict(path, lambda directory: load_wan_checkpoint(directory).state_dict)
        return load_wan_checkpoint(path).state_dict

    def build_model(self) -> torch.nn.Module:
        """The DiT: fresh, or from ``task.init``'s weights; with LoRA adapters (base frozen) when ``task.lora``."""
        model = self.bare_model()
        path = self.options.init
        if path:
            weights = checkpoint_weights(path)
            if weights is None:
                try:
                    weights = self.released_weights(path)
                except LoongForgeError as exc:
                    raise ConfigError(f"{self.source}: task.init {exc}") from None
            load_init(model, weights, path, self.flavor_name)
        if self.lora is not None:
            lora = self.lora
            for dit in (model.expert(name) for name in EXPERTS) if self.experts else (model,):
                apply_lora(dit, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets)
        return model

    def place_model(self, model: torch.nn.Module, backend: Any, device: Any) -> torch.nn.Module:
        """``task.experts_resident: one``: the high-noise expert on ``device``, the low-noise one in host memory
        (:class:`~loongforge_diffusion.wan.residency.ExpertResidency` swaps them as they serve); else all of it."""
        if self.options.experts_resident == "both":
            return model.to(device)
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(f"{self.source}: task.experts_resident: one runs on one process (a data-parallel "
                              "wrapper holds views of the parameters a swap moves); use both")
        self.residency = ExpertResidency({name: model.expert(name) for name in EXPERTS}, backend, device,
                                         extra=self.ema.shadows)
        return model

    def use_optimizer(self, optimizer: Any) -> None:
        """The waiting expert's AdamW moments wait in host memory with it (``task.experts_resident: one``)."""
        if self.residency is not None:
            self.residency.use_optimizer(optimizer)

    def after_step(self, model: torch.nn.Module) -> None:
        """After each optimizer step: update the EMA of the trained weights (``task.ema``)."""
        if self.experts:
            self.ema.after_step(model, self.trained_expert)
        else:
            self.ema.after_step(model)

    def build_dataset(self) -> Any:
        return self._dataset(self.options.data, self.options.samples, self.options.data_seed)

    def validation_dataset(self, paths: list[str], samples: int) -> Any:
        """``evaluation:``: the one written dataset or latent cache ``paths`` names, else -- for generated moving
        squares -- ``samples`` of them from the held-out data seed (written ``task.data`` has no held-out split)."""
        if len(paths) > 1:
            raise ConfigError(f"{self.source}: evaluation.data names {len(paths)} paths; a Wan run reads one "
                              "(a written dataset or a latent cache, like task.data)")
        if paths:
            return self._dataset(paths[0], samples, self.options.data_seed)
        if self.options.data is not None:
            raise no_held_out_data(self.source)
        return self._dataset(None, samples, self.options.data_seed + HELD_OUT_SEED_OFFSET)

    def _dataset(self, path: str | None, samples: int, seed: int) -> Any:
        """A latent cache directory, a written dataset, or (``path`` null) ``samples`` moving squares of ``seed``."""
        if path is not None and (Path(path).expanduser() / LATENT_INDEX).is_file():
            flavor = self.flavor
            return CachedLatentDataset(path, latent_channels=flavor.out_channels, text_dim=flavor.text_dim,
                                       in_channels=flavor.in_channels, image_dim=flavor.image_dim)
        return self.task.build_dataset(path, length=samples, text_dim=self.flavor.text_dim, seed=seed,
                                       frames=self.geometry.frames, side=self.geometry.side, speed=self.geometry.speed)

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss with noise drawn per sample from (seed, step, dataset index): the same draws on
        one process or spread over data-parallel ranks, so every layout trains the same run."""
        self.steps += 1
        generators = sample_generators(self.task.seed, self.steps, batch["index"])
        objective = self.task.objective
        if self.experts:
            self.trained_expert, objective = choose_grouped_expert(objective, self.flavor.expert_boundary,
                                                                   self.task.seed, self.steps,
                                                                   self.options.expert_window)
            if self.residency is not None:  # before the step, not in its forward: the step's storages are settled
                self.residency.serve(self.trained_expert)
        return self._loss(model, batch, generators, self.task.context_dropout, objective)

    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """The conditional flow-matching loss (no caption dropout) with the evaluation's per-sample draws."""
        return self._loss(model, batch, generators, 0.0, self.task.objective)

    def _loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], generators: list[torch.Generator],
              context_dropout: float, objective: Any) -> torch.Tensor:
        if self.cp is None:
            return flow_matching_step(model, batch, generators, objective, context_dropout=context_dropout,
                                      clean_first_frame=flavor_of(model).per_token_timesteps)
        return context_parallel_step(model, batch, generators, self.cp, objective,
                                     context_dropout=context_dropout,
                                     clean_first_frame=self.flavor.per_token_timesteps)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **self.ema.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.ema.load_state_dict(state)
        if self.residency is not None:  # the engine loaded the checkpoint into the model and optimizer just before
            self.residency.settle()

    def finish(self, model: torch.nn.Module, output_dir: Path, media: MediaLog) -> dict[str, Any]:
        """Sample held-out captions (a data seed never trained on), write GIFs, score them."""
        opts = self.sample_options
        if opts.videos <= 0 or self.options.data is not None:
            return {}  # written data or latent caches have no caption encoder here (and latents need the VAE)
        held_out = MovingSquares(opts.videos, text_dim=self.flavor.text_dim,
                                 seed=self.options.data_seed + HELD_OUT_SEED_OFFSET, geometry=self.geometry)
        items = [held_out[i] for i in range(len(held_out))]
        context = torch.stack([item["context"] for item in items])
        labels = torch.stack([item["labels"] for item in items])
        settings = SampleSettings(opts.seed, opts.steps, opts.guidance, opts.sampler)
        with self.ema.sampling_weights(model):
            videos = self._sample(model, context, settings)
        directory = Path(output_dir) / "samples"
        gallery = write_samples(videos, [caption(label) for label in labels], directory, settings)
        gallery.log(media, step=self.steps)
        return {"samples_dir": str(directory), "samples_grid": str(gallery.grid),
                "sample_scores": score_videos(videos, labels)}

    def sample_files(self, model: torch.nn.Module, prompts: list[str], out_dir: Path, settings: SampleSettings, *,
                     fmt: str) -> list[Path]:
        """``loongforge sample``: one video per moving-squares caption (``"a red square of size 4 moving right"``)."""
        if self.options.data is not None:
            raise ConfigError("sampling from prompts needs the captions' text encoder; this run trained on a "
                              "written dataset of precomputed caption states")
        try:
            labels = torch.stack([parse_caption(prompt) for prompt in prompts])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        context = embedding_table(self.flavor.text_dim)[caption_tokens(labels)]
        videos = self._sample(model, context, settings)
        return write_samples(videos, prompts, Path(out_dir), settings, fmt=fmt).files

    def _sample(self, model: torch.nn.Module, context: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
        """Videos ``(B, 3, frames, side, side)`` for caption states ``context (B, L, text_dim)``, sampled as
        ``settings`` say, the steps shown as progress (sampling a batch of videos on a CPU takes a minute)."""
        geometry = self.geometry
        shape = (context.shape[0], 3, geometry.frames, geometry.side, geometry.side)
        with job_progress(f"sampling {shape[0]} videos", total=settings.steps, unit="step") as progress:
            return self.task.sample(model, {"context": context}, settings.steps, shape=shape,
                                    guidance=settings.guidance, seed=settings.seed, sampler=settings.sampler,
                                    on_step=lambda _: progress.advance())
