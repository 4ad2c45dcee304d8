"""One flow-matching training step for a Wan-style video DiT: noise a clean batch, predict, regress.

Returns the loss and leaves backward/optimizer to the caller, so the same step serves a plain loop, the core
trainer's task adapter, and parity checks. ``clean_first_frame`` is Wan 2.2 TI2V's image conditioning: the first
latent frame is kept clean, its tokens get timestep 0 (per-token timesteps) and it is left out of the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loongforge_diffusion.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    FlowMatchingConfig,
    interpolate,
    loss_weight,
    sample_sigmas,
    velocity_target,
)


def flavor_of(model: torch.nn.Module) -> Any:
    """The flavor of a model, also when a data-parallel wrapper (DDP's ``.module``) holds it."""
    return getattr(model, "module", model).flavor


def token_timesteps(sigma: torch.Tensor, grid: tuple[int, int, int], clean_frames: int) -> torch.Tensor:
    """``(B, tokens)`` timesteps: ``1000 sigma`` everywhere but 0 on the first ``clean_frames`` latent frames."""
    frames, rows, cols = grid
    per_frame = (sigma[:, None] * NUM_TRAIN_TIMESTEPS).expand(-1, frames).clone()
    per_frame[:, :clean_frames] = 0
    return per_frame.repeat_interleave(rows * cols, dim=1)


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs and regression target, drawn before the model runs.

    Split from the loss so that a context-parallel step (``loongforge_diffusion.parallel``) draws exactly the
    same noise levels, noise and caption dropout from the same generator, then keeps only its tokens.
    ``mask (B, 1, T, H, W)`` is 0 where the loss ignores the video (the clean first frame of TI2V).
    """

    model_input: torch.Tensor
    timestep: torch.Tensor
    context: torch.Tensor
    image_context: torch.Tensor | None
    target: torch.Tensor
    mask: torch.Tensor
    weight: torch.Tensor


Generators = torch.Generator | Sequence[torch.Generator]


def _draw(generator: Generators, batch_size: int, draw: Callable[[int, torch.Generator], torch.Tensor]) -> torch.Tensor:
    """``draw(n, generator)`` for the whole batch from one generator, or sample by sample from one generator each
    (what makes a step's randomness independent of how samples are spread over data-parallel ranks)."""
    if isinstance(generator, torch.Generator):
        return draw(batch_size, generator)
    if len(generator) != batch_size:
        raise ValueError(f"{len(generator)} generators for a batch of {batch_size}")
    return torch.cat([draw(1, g) for g in generator])


def step_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor], generator: Generators,
                config: FlowMatchingConfig = FlowMatchingConfig(), *, context_dropout: float = 0.0,
                clean_first_frame: bool = False) -> StepInputs:
    """Noise ``batch`` for one step; the arguments are those of :func:`flow_matching_step`."""
    x0 = batch["video"]
    batch_size, device = x0.shape[0], x0.device
    sigma = _draw(generator, batch_size, lambda n, g: sample_sigmas(n, config, g)).to(device)
    noise = _draw(generator, batch_size,
                  lambda n, g: torch.randn((n, *x0.shape[1:]), generator=g, dtype=x0.dtype)).to(device)
    noisy = interpolate(x0, noise, sigma)
    mask = torch.ones_like(x0[:, :1])
    if clean_first_frame:
        patch = flavor_of(model).patch_size
        grid = tuple(n // p for n, p in zip(x0.shape[2:], patch, strict=True))
        noisy = torch.cat([x0[:, :, :patch[0]], noisy[:, :, patch[0]:]], dim=2)
        mask[:, :, :patch[0]] = 0
        timestep = token_timesteps(sigma, grid, clean_frames=1)
    else:
        timestep = sigma * NUM_TRAIN_TIMESTEPS
    context = batch["context"]
    if context_dropout > 0:
        keep = _draw(generator, batch_size, lambda n, g: torch.rand(n, generator=g)) >= context_dropout
        context = context * keep.to(device=device, dtype=context.dtype)[:, None, None]
    model_input = noisy if "condition" not in batch else torch.cat([noisy, batch["condition"]], dim=1)
    return StepInputs(model_input, timestep, context, batch.get("image_context"), velocity_target(x0, noise), mask,
                      loss_weight(sigma, config.weighting))


def flow_matching_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], generator: Generators,
                       config: FlowMatchingConfig = FlowMatchingConfig(), *, context_dropout: float = 0.0,
                       clean_first_frame: bool = False) -> torch.Tensor:
    """The mean flow-matching loss of ``model`` on ``batch``.

    :param batch: ``video`` (B, C, T, H, W) clean latents, ``context`` (B, L, text_dim); optionally
        ``condition`` (I2V channels concatenated to the noisy input) and ``image_context`` (CLIP tokens).
    :param generator: a CPU generator for noise levels, noise and caption dropout (reproducible steps), or one
        generator per sample (the same draws wherever the sample is trained).
    :param context_dropout: probability of zeroing a sample's caption, which teaches the unconditional
        velocity classifier-free guidance needs.
    """
    inputs = step_inputs(model, batch, generator, config, context_dropout=context_dropout,
                         clean_first_frame=clean_first_frame)
    prediction = model(inputs.model_input, inputs.timestep, inputs.context, inputs.image_context)
    return flow_matching_loss(prediction, inputs)


def flow_matching_loss(prediction: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """The weighted mean squared velocity error of a prediction shaped like ``inputs.target`` (``(B, C, ...)``,
    any layout: a video, or an image's packed tokens), over the positions ``inputs.mask`` keeps; shared by
    every model family, whatever its call signature."""
    mask = inputs.mask
    squared = ((prediction.float() - inputs.target.float()) ** 2 * mask).flatten(1).sum(dim=1)
    per_sample = squared / (mask.flatten(1).sum(dim=1) * inputs.target.shape[1])
    return (per_sample * inputs.weight).mean()
