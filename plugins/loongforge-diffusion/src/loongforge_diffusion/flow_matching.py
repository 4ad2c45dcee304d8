"""The rectified-flow (flow-matching) objective Wan is trained with.

A clean latent ``x0`` and noise ``eps`` are joined on a straight line, ``x_s = (1 - s) x0 + s eps`` with the
noise level ``s`` in [0, 1], and the model learns the constant velocity along it, ``eps - x0``. The model
sees the timestep ``1000 s``. Which noise levels training visits decides what the model is good at, hence:

- the *shift* ``s' = k s / (1 + (k - 1) s)`` pushes samples towards high noise (k > 1), as high-resolution
  video needs (Wan samples with k = 3..12);
- *logit-normal* sampling (SD3) concentrates on mid noise levels instead of uniform;
- an expert's *sigma range* ``[low, high)`` restricts training to the noise levels one expert serves: Wan 2.2
  A14B is two models, the high-noise one for ``s >= boundary`` and the low-noise one below;
- *loss weighting* can re-weight noise levels (``cosmap`` from SD3) instead of re-sampling them.
"""

from __future__ import annotations

import math

import torch
from loongforge.errors import ConfigError

# The objective's settings are a torch-free config section (``task.flow_matching``); re-exported here.
from loongforge_diffusion.options import SAMPLING as SAMPLING
from loongforge_diffusion.options import WEIGHTING as WEIGHTING
from loongforge_diffusion.options import FlowMatchingConfig as FlowMatchingConfig

#: Wan (like most flow models) is trained with timesteps ``1000 * sigma``.
NUM_TRAIN_TIMESTEPS = 1000


def expert_sigma_range(boundary: float, expert: str) -> tuple[float, float]:
    """The noise levels one Wan 2.2 A14B expert serves: ``high`` takes ``[boundary, 1)``, ``low`` ``[0, boundary)``."""
    if expert == "high":
        return (boundary, 1.0)
    if expert == "low":
        return (0.0, boundary)
    raise ConfigError(f"expert must be 'high' or 'low', got {expert!r}")


def shift_sigma(sigma: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """``k s / (1 + (k - 1) s)``: monotonic, fixes 0 and 1, and moves every other level towards 1 when k > 1."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def unshift_sigma(sigma: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """The inverse of :func:`shift_sigma`."""
    return sigma / (shift - (shift - 1) * sigma)


def sigma_mass(config: FlowMatchingConfig, low: float, high: float) -> float:
    """The probability the objective's base distribution (before conditioning on ``sigma_range``) gives the shifted
    noise levels ``[low, high)``: how often a run without the range would train them."""
    bounds = torch.tensor([unshift_sigma(low, config.shift), unshift_sigma(high, config.shift)], dtype=torch.float64)
    if config.sampling == "uniform":
        return float(bounds[1] - bounds[0])
    cdf = torch.special.ndtr((torch.logit(bounds) - config.logit_mean) / config.logit_std)
    return float(cdf[1] - cdf[0])


def sample_sigmas(batch: int, config: FlowMatchingConfig, generator: torch.Generator) -> torch.Tensor:
    """``batch`` noise levels: drawn from the base distribution *conditioned* on landing, after the shift, in
    ``config.sigma_range``. Conditioning by inverse CDF (not by rejection) keeps the cost fixed and the
    distribution within the range exactly the base one, renormalised."""
    low, high = (unshift_sigma(s, config.shift) for s in config.sigma_range)
    uniform = torch.rand(batch, generator=generator, dtype=torch.float64)
    if config.sampling == "uniform":
        base = low + (high - low) * uniform
    else:
        mean, std = config.logit_mean, config.logit_std
        bounds = torch.tensor([low, high], dtype=torch.float64)
        cdf_low, cdf_high = torch.special.ndtr((torch.logit(bounds) - mean) / std)
        normal = torch.special.ndtri(cdf_low + (cdf_high - cdf_low) * uniform)
        base = torch.sigmoid(mean + std * normal).clamp(low, high)
    return shift_sigma(base, config.shift).float()


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``(1 - s) x0 + s eps`` with ``sigma`` broadcast from the batch dimension."""
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity of the straight path from data to noise, ``eps - x0``."""
    return noise - x0


def loss_weight(sigma: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample loss weights; ``cosmap`` is SD3's ``2 / (pi (1 - 2s + 2s^2))`` (favours mid noise)."""
    if weighting == "none":
        return torch.ones_like(sigma)
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    raise ConfigError(f"flow matching: weighting must be one of {WEIGHTING}, got {weighting!r}")
