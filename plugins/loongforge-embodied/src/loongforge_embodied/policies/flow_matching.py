"""Pi0's flow-matching objective over action chunks, and Euler sampling.

Time ``t`` runs from data (0) to noise (1): ``x_t = t * noise + (1 - t) * actions`` and the model predicts the
velocity ``noise - actions``. Training draws ``t ~ Beta(1.5, 1)`` scaled into ``[0.001, 1]``, which puts more
weight on noisy times (Pi0's choice). Every draw takes an explicit generator per sample, so the draws depend on
(seed, step, dataset index) only and every data-parallel layout trains the same run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: Pi0: Beta(alpha, beta) time, scaled into [T_MIN, 1].
ALPHA, BETA, T_MIN = 1.5, 1.0, 0.001


def sample_time(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B,) times, one per generator. Beta(a, 1) has CDF ``x**a``, so ``u**(1/a)`` samples it exactly."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    beta = u ** (1.0 / ALPHA)
    return (beta * (1.0 - T_MIN) + T_MIN).float()


def sample_noise(shape: Sequence[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B, *shape) standard normal noise, each sample from its own generator."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)`` for (B, H, A) chunks at times (B,)."""
    tt = t[:, None, None]
    return tt * noise + (1.0 - tt) * actions, noise - actions


def masked_loss(velocity: torch.Tensor, target: torch.Tensor, is_pad: torch.Tensor, action_dim: int) -> torch.Tensor:
    """Mean squared error over the real action dims, padded steps (past the episode end) zeroed out.

    Divided by the full element count (LeRobot's convention), so the loss of a batch is the mean of its samples'
    losses and data-parallel ranks average to the single-process value exactly.
    """
    error = (velocity[..., :action_dim] - target[..., :action_dim]) ** 2
    return (error * (~is_pad)[..., None]).mean()


def euler_sample(velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                 steps: int) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t)`` from ``t = 1`` (``noise``) to ``t = 0`` in ``steps`` equal Euler steps."""
    x, dt = noise, -1.0 / steps
    for k in range(steps):
        t = torch.full((x.shape[0],), 1.0 + k * dt, dtype=x.dtype, device=x.device)
        x = x + dt * velocity_fn(x, t)
    return x
