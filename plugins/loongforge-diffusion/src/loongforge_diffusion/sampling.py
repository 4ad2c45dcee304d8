"""Sampling a flow-matching model: integrate the predicted velocity from noise (s = 1) to data (s = 0) with Euler
or, by name (``task.sample.sampler``, ``loongforge sample --sampler``; :data:`loongforge_diffusion.options.SAMPLERS`),
with the multistep solvers of :mod:`loongforge_diffusion.multistep`.

The velocity is whatever callable the caller passes -- one model, classifier-free guidance around it, or Wan 2.2's
two experts switched by noise level -- so each integrator stays one short loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loongforge_diffusion.flow_matching import shift_sigma
from loongforge_diffusion.options import SAMPLERS

Velocity = Callable[[torch.Tensor, float], torch.Tensor]


def sigma_schedule(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` noise levels from 1 down to 0, evenly spaced before the shift (so the shift spends more
    steps at high noise, where the coarse layout is decided)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return [float(shift_sigma(1 - i / steps, shift)) for i in range(steps + 1)]


@torch.no_grad()
def euler_sample(velocity: Velocity, noise: torch.Tensor, sigmas: list[float], *,
                 on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """``x <- x + (s_next - s) v(x, s)`` along ``sigmas``; exact whenever the velocity is constant along each path.

    ``on_step(n)``, when given, is called after the ``n``-th step (1-based): what a progress display counts.
    """
    x = noise
    for step, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:], strict=True), start=1):
        x = x + (sigma_next - sigma) * velocity(x, sigma)
        if on_step is not None:
            on_step(step)
    return x


def guided(conditional: Velocity, unconditional: Velocity, scale: float) -> Velocity:
    """Classifier-free guidance: ``v_u + scale (v_c - v_u)``."""

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        base = unconditional(x, sigma)
        return base + scale * (conditional(x, sigma) - base)

    return velocity


def switch_experts(high_noise: Velocity, low_noise: Velocity, boundary: float) -> Velocity:
    """Wan 2.2 A14B: the high-noise expert for ``sigma >= boundary``, the low-noise expert below."""
    return lambda x, sigma: high_noise(x, sigma) if sigma >= boundary else low_noise(x, sigma)


def integrate(velocity: Velocity, noise: torch.Tensor, steps: int, *, shift: float, sampler: str = "euler",
              on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """``noise`` carried to data by ``steps`` steps of ``sampler`` (one of :data:`SAMPLERS`) on its own schedule of
    noise levels, shifted by ``shift``."""
    from loongforge_diffusion import multistep

    if sampler == "euler":
        return euler_sample(velocity, noise, sigma_schedule(steps, shift), on_step=on_step)
    if sampler == "unipc":
        return multistep.unipc_sample(velocity, noise, multistep.unipc_sigmas(steps, shift), on_step=on_step)
    if sampler == "dpm++":
        return multistep.dpm_solver_pp_sample(velocity, noise, multistep.dpm_solver_sigmas(steps, shift),
                                              on_step=on_step)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
