"""``loongforge train`` for Qwen-Image MMDiTs: text-to-image flow matching in pixel space on still squares.

A run config names a Qwen-Image flavor whose channels fit RGB pixels packed into 2x2 patches (the same packing the
Qwen-Image pipeline applies to VAE latents: ``in_channels = 3 * 2 * 2 = 12``, ``out_channels = 3``) and puts the
options under ``task:`` (see ``configs/diffusion-squares-image.yaml``)::

    task:
      samples: 2048           # still squares generated on the fly (no download): how many, and their side
      side: 16
      data_seed: 0
      context_dropout: 0.1    # caption dropout, which classifier-free guidance needs
      flow_matching: {shift: 1.0, sampling: uniform, weighting: none}
      sample: {images: 16, steps: 20, guidance: 3.0, shift: 1.0, seed: 0}   # after training; images: 0 skips it
      init: null              # weights to start from: a LoongForge checkpoint of this task, or a diffusers
                              #   QwenImageTransformer2DModel directory (*.safetensors, or under transformer/)
      ema: null               # {decay: 0.999, warmup: true}: samples use the averaged weights
      recompute: false        # activation checkpointing per block

The model takes the noise level ``sigma`` in ``[0, 1]`` as its timestep (it scales by 1000 itself, as diffusers'
pipeline passes ``timestep / 1000``). Noise is drawn per sample from (seed, step, dataset index), so ddp/fsdp2 runs
train the same run as one process. With ``evaluation.interval > 0`` core's loop logs the validation loss: the
conditional flow-matching loss (no caption dropout) of the trained weights on still squares of the held-out data
seed, with the same noise and noise levels at every evaluation. After training the task samples held-out captions
with classifier-free guidance (the denoising steps shown as progress), writes PNGs, a captioned ``grid.png`` and
``index.json`` to ``<output_dir>/samples`` (:func:`loongforge_diffusion.media.write_samples`), sends the images with
their captions to the run's trackers (tag ``samples``, at the last step) and scores colour and square-ness
(:mod:`loongforge_diffusion.scoring`). ``loongforge sample CHECKPOINT --prompt "a red square of size 4" --format
png`` samples new captions later (the same files, grid and index in ``--out``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loongforge.config.plugin_sections import task_options
from loongforge.errors import ConfigError
from loongforge.progress import job_progress
from loongforge.tasks import TaskBase, sample_generators
from loongforge.train.media import MediaLog

from loongforge_diffusion.data.moving_squares import caption, parse_caption
from loongforge_diffusion.data.still_squares import StillSquares, still_context
from loongforge_diffusion.flow_matching import NUM_TRAIN_TIMESTEPS
from loongforge_diffusion.media import SampleSettings, write_samples
from loongforge_diffusion.options import QwenImageTaskOptions
from loongforge_diffusion.qwen_image.flavors import QwenImageFlavor
from loongforge_diffusion.qwen_image.model import QwenImageModel, pack_latents, unpack_latents
from loongforge_diffusion.run_options import HELD_OUT_SEED_OFFSET, EMAOption, checkpoint_weights, load_init
from loongforge_diffusion.sampling import guided, integrate
from loongforge_diffusion.scoring import score_videos
from loongforge_diffusion.training import flow_matching_loss, step_inputs

#: RGB: the pixel channels a token packs ``patch_size ** 2`` of.
CHANNELS = 3
#: Formats ``loongforge sample`` can write an image in.
IMAGE_FORMATS = ("png", "gif")


class QwenImageRunTask(TaskBase):
    """Flow-matching training of one Qwen-Image flavor on still squares; see the module docstring."""

    def __init__(self, flavor: QwenImageFlavor, config: Any) -> None:
        source = config.source
        self.options: QwenImageTaskOptions = task_options(flavor, config)
        self.sample_options = self.options.sample
        self.objective = self.options.flow_matching
        self.flavor = flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor
        self.flavor_name = config.model.name
        self.source = source
        p = self.flavor.patch_size
        if self.flavor.in_channels != CHANNELS * p * p or self.flavor.out_channels != CHANNELS:
            raise ConfigError(f"model '{self.flavor_name}' in {source}: pixel-space training needs in_channels "
                              f"{CHANNELS * p * p} (RGB in {p}x{p} patches) and out_channels {CHANNELS}, the flavor "
                              f"has {self.flavor.in_channels} and {self.flavor.out_channels}; set them in "
                              "model.overrides")
        self.side = self.options.side
        if self.side % p:
            raise ConfigError(f"task.side {self.side} in {source} must be a multiple of the patch size {p}")
        self.context_dropout = self.options.context_dropout
        self.ema = EMAOption(self.options.ema)
        self.seed = config.run.seed
        #: Training steps taken (with the sample index, it seeds each sample's noise).
        self.steps = 0

    def build_model(self) -> torch.nn.Module:
        """The MMDiT: fresh (adaLN-Zero), or with ``task.init``'s weights.

        The last block's text-stream output projection and FFN are frozen: the head reads only image tokens, so
        they never reach the loss (diffusers' model carries them too, for weight compatibility). Frozen, they
        train exactly as before (no gradient either way) and DDP does not wait for gradients that never come.
        """
        model = QwenImageModel(self.flavor, recompute=self.options.recompute)
        path = self.options.init
        if path:
            weights = checkpoint_weights(path)
            load_init(model, _released_weights(path, self.flavor) if weights is None else weights, path,
                      self.flavor_name)
        last_text = model.blocks[-1].txt
        for unused in (last_text.out, last_text.ffn):
            unused.requires_grad_(False)
        return model

    def build_dataset(self) -> StillSquares:
        opts = self.options
        return StillSquares(opts.samples, text_dim=self.flavor.text_dim, seed=opts.data_seed, side=self.side)

    def validation_dataset(self, paths: list[str], samples: int) -> StillSquares:
        """``evaluation:``: ``samples`` still squares of the held-out data seed (still squares are generated, so
        there are no paths to read)."""
        if paths:
            raise ConfigError(f"{self.source}: evaluation.data: a Qwen-Image run generates its still squares and "
                              "reads no data files; leave evaluation.data empty (the held-out data seed is used)")
        return StillSquares(samples, text_dim=self.flavor.text_dim,
                            seed=self.options.data_seed + HELD_OUT_SEED_OFFSET, side=self.side)

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss on packed pixel tokens, with each sample's noise level, noise and caption
        dropout drawn from its own (seed, step, dataset index) generator."""
        self.steps += 1
        generators = sample_generators(self.seed, self.steps, batch["index"])
        return self._loss(model, batch, generators, self.context_dropout)

    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """The conditional flow-matching loss (no caption dropout) with the evaluation's per-sample draws."""
        return self._loss(model, batch, generators, 0.0)

    def _loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], generators: list[torch.Generator],
              context_dropout: float) -> torch.Tensor:
        x0 = pack_latents(batch["image"], self.flavor.patch_size)
        inputs = step_inputs(model, {"video": x0, "context": batch["context"]}, generators, self.objective,
                             context_dropout=context_dropout)
        sigma = inputs.timestep / NUM_TRAIN_TIMESTEPS  # the model takes the noise level itself
        prediction = model(inputs.model_input, inputs.context, None, sigma, self._grids(x0.shape[0]))
        return flow_matching_loss(prediction, inputs)

    def after_step(self, model: torch.nn.Module) -> None:
        """After each optimizer step: update the EMA of the trained weights (``task.ema``)."""
        self.ema.after_step(model)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **self.ema.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.ema.load_state_dict(state)

    def finish(self, model: torch.nn.Module, output_dir: Path, media: MediaLog) -> dict[str, Any]:
        """Sample held-out captions (a data seed never trained on), write PNGs, score colour and square-ness."""
        opts = self.sample_options
        if opts.images <= 0:
            return {}
        held_out = StillSquares(opts.images, text_dim=self.flavor.text_dim,
                                seed=self.options.data_seed + HELD_OUT_SEED_OFFSET, side=self.side)
        items = [held_out[i] for i in range(len(held_out))]
        labels = torch.stack([item["labels"] for item in items])
        settings = SampleSettings(opts.seed, opts.steps, opts.guidance, opts.sampler)
        with self.ema.sampling_weights(model):
            images = self.sample(model, torch.stack([item["context"] for item in items]), settings)
        directory = Path(output_dir) / "samples"
        gallery = write_samples(images[:, :, None], [caption(label, moving=False) for label in labels], directory,
                                settings, fmt="png", still=True)
        gallery.log(media, step=self.steps)
        return {"samples_dir": str(directory), "samples_grid": str(gallery.grid),
                "sample_scores": score_videos(images[:, :, None], labels)}

    def sample_files(self, model: torch.nn.Module, prompts: list[str], out_dir: Path, settings: SampleSettings, *,
                     fmt: str) -> list[Path]:
        """``loongforge sample``: one image per still-squares caption (``"a red square of size 4"``)."""
        if fmt not in IMAGE_FORMATS:
            raise ConfigError(f"sample format '{fmt}' is not an image format; use one of {', '.join(IMAGE_FORMATS)}")
        try:
            labels = torch.stack([parse_caption(prompt, moving=False) for prompt in prompts])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        images = self.sample(model, still_context(labels, self.flavor.text_dim), settings)
        return write_samples(images[:, :, None], prompts, Path(out_dir), settings, fmt=fmt, still=True).files

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, context: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
        """Images ``(B, 3, side, side)`` in [-1, 1] for caption states ``context (B, L, text_dim)``, by
        ``settings.steps`` steps of ``settings.sampler`` (shifted by ``task.sample.shift``) from seeded noise;
        guidance other than 1 guides against the all-zero caption that caption dropout trained the unconditional
        velocity on. The steps are shown as progress."""
        steps, guidance, shift = settings.steps, settings.guidance, self.sample_options.shift
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        context = context.to(device)
        grids = self._grids(context.shape[0])

        def velocity_for(ctx: torch.Tensor):
            return lambda x, sigma: model(x, ctx, None, torch.full((x.shape[0],), sigma, device=device), grids)

        velocity = velocity_for(context)
        if guidance != 1.0:
            velocity = guided(velocity, velocity_for(torch.zeros_like(context)), guidance)
        p = self.flavor.patch_size
        noise = torch.randn((context.shape[0], CHANNELS, self.side, self.side),
                            generator=torch.Generator().manual_seed(settings.seed))
        with job_progress(f"sampling {context.shape[0]} images", total=steps, unit="step") as progress:
            tokens = integrate(velocity, pack_latents(noise, p).to(device), steps, shift=shift,
                               sampler=settings.sampler, on_step=lambda _: progress.advance())
        model.train(was_training)
        return unpack_latents(tokens, self.side // p, self.side // p, p)

    def _grids(self, batch: int) -> list[tuple[int, int, int]]:
        """``img_shapes`` for a batch: one image of ``side / p`` x ``side / p`` tokens per sample."""
        tokens = self.side // self.flavor.patch_size
        return [(1, tokens, tokens)] * batch


def _released_weights(path: str, flavor: QwenImageFlavor) -> dict[str, torch.Tensor]:
    """Our state dict from a diffusers ``QwenImageTransformer2DModel`` directory (its ``*.safetensors`` shards,
    directly in ``path`` or under ``transformer/`` of a pipeline directory)."""
    from safetensors.torch import load_file

    from loongforge_diffusion.qwen_image.diffusers_adapter import from_diffusers

    located = released_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(located.values())):
        state.update(load_file(str(file)))
    return from_diffusers(state, flavor)


def released_shapes(path: str, flavor: QwenImageFlavor) -> dict[str, tuple[int, ...]]:
    """Our names and shapes of a diffusers Qwen-Image transformer directory, from its files' headers alone (what
    ``check`` holds ``task.init`` to)."""
    from loongforge_diffusion.qwen_image.diffusers_adapter import from_diffusers
    from loongforge_diffusion.wan.checkpoint import meta_tensors

    return {name: tuple(t.shape) for name, t in from_diffusers(meta_tensors(released_files(path)), flavor).items()}


def released_files(path: str) -> dict[str, Path]:
    """Tensor name -> the readable safetensors file holding it, directly in ``path`` or under ``transformer/``."""
    from loongforge_diffusion.wan.checkpoint import weight_files

    directory = Path(path).expanduser()
    if not any(directory.glob("*.safetensors")) and any((directory / "transformer").glob("*.safetensors")):
        directory = directory / "transformer"
    if not any(directory.glob("*.safetensors")):
        raise ConfigError(f"task.init {path}: neither a LoongForge checkpoint (no manifest) nor a diffusers "
                          "Qwen-Image transformer directory (no *.safetensors here or under transformer/)")
    return weight_files(directory)
