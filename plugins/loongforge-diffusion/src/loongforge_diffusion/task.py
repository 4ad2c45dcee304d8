"""``DiffusionTask``: everything a trainer needs to train and sample a Wan-style DiT, behind four methods.

The core trainer drives LLMs through megatron's GPT forward step; a task object is the seam through which it can
drive other model kinds. This one exposes ``build_model``, ``build_dataset``, ``training_step`` and ``sample``,
so the core side is a thin adapter (make model, optimizer and loader; call ``training_step``; back-propagate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares, TensorVideoDataset
from loongforge_diffusion.flow_matching import NUM_TRAIN_TIMESTEPS, FlowMatchingConfig
from loongforge_diffusion.sampling import guided, integrate
from loongforge_diffusion.training import flavor_of, flow_matching_step
from loongforge_diffusion.wan.flavors import WanFlavor
from loongforge_diffusion.wan.model import WanModel


def resolve_family(flavor: str | WanFlavor) -> WanFlavor:
    """A flavor object, or a name (or alias) looked up in the ``model`` registry that plugins fill."""
    if isinstance(flavor, WanFlavor):
        return flavor
    from loongforge.plugins import get_host

    resolved = get_host().registry("model").load(flavor, where="DiffusionTask.build_model")
    if not isinstance(resolved, WanFlavor):
        raise TypeError(f"'{flavor}' is a {type(resolved).__name__}, not a Wan flavor")
    return resolved


@dataclass
class DiffusionTask:
    """Flow-matching training and Euler sampling of a Wan DiT.

    :param objective: noise-level sampling, shift, expert range and loss weighting.
    :param context_dropout: caption dropout during training (enables classifier-free guidance).
    :param seed: seeds the task's generator, so steps (noise, levels, dropout) are reproducible.
    """

    objective: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    context_dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def build_model(self, flavor: str | WanFlavor, device: str | torch.device = "cpu", **overrides) -> WanModel:
        """A freshly initialised model; ``overrides`` change flavor fields (``num_layers=2``)."""
        resolved = resolve_family(flavor)
        return WanModel(resolved.with_overrides(**overrides) if overrides else resolved).to(device)

    def build_dataset(self, path: str | Path | None = None, *, length: int = 1024, text_dim: int = 32, seed: int = 0,
                      frames: int = 4, side: int = 16, speed: int = 2) -> Dataset:
        """A written dataset (``path``, see ``loongforge make-data moving-squares``) or
        moving squares generated on the fly."""
        if path is not None:
            return TensorVideoDataset(path)
        return MovingSquares(length, text_dim=text_dim, seed=seed, geometry=Geometry(frames, side, speed))

    def training_step(self, model: WanModel, batch: dict[str, torch.Tensor],
                      generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
        """The loss of one batch (the caller runs backward and the optimizer); ``generator`` (one, or one per
        sample) replaces the task's own."""
        return flow_matching_step(model, batch, self.generator if generator is None else generator, self.objective,
                                  context_dropout=self.context_dropout,
                                  clean_first_frame=flavor_of(model).per_token_timesteps)

    @torch.no_grad()
    def sample(self, model: WanModel, cond: dict[str, torch.Tensor], steps: int, *, shape: tuple[int, ...],
               guidance: float = 1.0, shift: float | None = None, seed: int = 0, sampler: str = "euler",
               on_step: Callable[[int], None] | None = None) -> torch.Tensor:
        """Videos of ``shape`` (B, C, T, H, W) for the captions ``cond["context"]``, by ``steps`` steps of
        ``sampler`` (:func:`loongforge_diffusion.sampling.integrate`);
        ``cond`` may also hold the I2V ``condition`` channels and ``image_context`` tokens. ``on_step(n)`` is
        called after each step (a progress display).

        ``guidance > 1`` applies classifier-free guidance against an all-zero caption (what caption dropout
        trained the unconditional velocity on). ``shift`` defaults to the flavor's sampling shift.
        """
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        context = cond["context"].to(device)
        image_context, condition = cond.get("image_context"), cond.get("condition")

        def velocity_for(ctx: torch.Tensor):
            def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
                timestep = torch.full((x.shape[0],), sigma * NUM_TRAIN_TIMESTEPS, device=device)
                model_input = x if condition is None else torch.cat([x, condition], dim=1)
                return model(model_input, timestep, ctx, image_context)
            return velocity

        velocity = velocity_for(context)
        if guidance != 1.0:
            velocity = guided(velocity, velocity_for(torch.zeros_like(context)), guidance)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
        video = integrate(velocity, noise, steps, shift=model.flavor.sample_shift if shift is None else shift,
                          sampler=sampler, on_step=on_step)
        model.train(was_training)
        return video
