"""The multistep solvers diffusers ships for Wan and Qwen-Image -- DPM-Solver++ (2M) and UniPC (bh2, order 2) --
for flow-matching models, written against our velocity callables and checked step for step against diffusers'
``DPMSolverMultistepScheduler`` / ``UniPCMultistepScheduler`` (``use_flow_sigmas``, ``prediction_type=
"flow_prediction"``) in tests/diffusion/test_multistep_samplers.py.

Why not Euler alone: both reuse the previous step's prediction to take second-order steps for the price of one
model call each, so 20 steps of them land where Euler needs many more. Both work in the data prediction a flow
model implies, ``x0 = x - sigma * v``, along the half log signal-to-noise ratio ``lambda = log((1 - sigma) /
sigma)``; the first step is first order (no history yet) and so is the last, into ``sigma = 0``, which returns
that step's ``x0`` exactly. UniPC adds a corrector: once the next step's prediction exists, the sample it was made
at is refined with it (no extra model call) before the next predictor step.

Schedules are diffusers' own for each solver (they differ: DPM-Solver++ starts at ``1 - 1/1000`` before the shift,
UniPC at 1, nudged by 1e-6 so that ``lambda`` stays finite), so a sampler's noise levels equal what diffusers'
pipelines use with the same ``flow_shift``. Our models are called at the exact ``sigma``; diffusers' pipelines
pass the timestep rounded down to an integer, a difference of conditioning rather than of the solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from loongforge_diffusion.flow_matching import shift_sigma

Velocity = Callable[[torch.Tensor, float], torch.Tensor]
#: Training timesteps of the schedules diffusers derives flow sigmas from.
TRAIN_TIMESTEPS = 1000


def dpm_solver_sigmas(steps: int, shift: float) -> list[float]:
    """DPM-Solver++'s ``steps + 1`` noise levels: ``j (1 - 1/1000) / steps`` for ``j = steps .. 1``, shifted, then 0."""
    _check(steps)
    top = 1 - 1 / TRAIN_TIMESTEPS
    return [float(shift_sigma(j * top / steps, shift)) for j in range(steps, 0, -1)] + [0.0]


def unipc_sigmas(steps: int, shift: float) -> list[float]:
    """UniPC's ``steps + 1`` noise levels: ``1 - j (1 - 1/1000) / steps`` for ``j = 0 .. steps - 1``, shifted (the
    first lowered by 1e-6 when it is 1), then 0."""
    _check(steps)
    top = 1 - 1 / TRAIN_TIMESTEPS
    sigmas = [float(shift_sigma(1 - j * top / steps, shift)) for j in range(steps)]
    if abs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6
    return sigmas + [0.0]


def _check(steps: int) -> None:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")


def _lambda(sigma: float) -> float:
    """Half the log signal-to-noise ratio of a flow path at ``sigma`` (signal ``1 - sigma``, noise ``sigma``)."""
    return math.log(1 - sigma) - math.log(sigma)


@torch.no_grad()
def dpm_solver_pp_sample(velocity: Velocity, noise: torch.Tensor, sigmas: list[float], *,
                         on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """DPM-Solver++(2M), midpoint form, along ``sigmas`` (:func:`dpm_solver_sigmas`)."""
    x, previous = noise, None  # previous: (x0, lambda) of the step before
    for step, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:], strict=True), start=1):
        x0 = x - sigma * velocity(x, sigma)
        if sigma_next == 0:
            x = x0  # the first-order step into sigma = 0 lands on the prediction
        else:
            lam, lam_next = _lambda(sigma), _lambda(sigma_next)
            h = lam_next - lam
            target = x0
            if previous is not None:  # second order: the slope of x0 over lambda from the previous step
                x0_before, lam_before = previous
                target = x0 + 0.5 * (x0 - x0_before) * h / (lam - lam_before)
            x = (sigma_next / sigma) * x - (1 - sigma_next) * math.expm1(-h) * target
        previous = (x0, _lambda(sigma))
        if on_step is not None:
            on_step(step)
    return x


@torch.no_grad()
def unipc_sample(velocity: Velocity, noise: torch.Tensor, sigmas: list[float], *,
                 on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """UniPC (B(h) = e^h - 1, order 2, corrector on every step after the first) along ``sigmas``
    (:func:`unipc_sigmas`)."""
    steps = len(sigmas) - 1
    x = noise
    history: list[tuple[torch.Tensor, float]] = []  # (x0, lambda) of earlier steps, newest last
    before: tuple[torch.Tensor, int] | None = None  # the sample the last predictor started from, and its order
    for i in range(steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        x0 = x - sigma * velocity(x, sigma)
        if before is not None:  # correct the sample this prediction was made at, with the prediction itself
            x = _unic(before[0], x0, history, _lambda(sigma), sigmas[i - 1], sigma, before[1])
        history = [*history[-1:], (x0, _lambda(sigma))]
        order = min(2, steps - i, len(history))
        before = (x, order)
        x = x0 if sigma_next == 0 else _unip(x, history, sigma, sigma_next, order)
        if on_step is not None:
            on_step(i + 1)
    return x


def _phi_terms(h: float) -> tuple[float, float, float, float]:
    """For step size ``h`` in lambda: ``e^-h - 1``, the bh2 scale ``B = e^-h - 1`` and the right-hand sides of
    UniPC's order conditions (``b1``, ``b2``)."""
    hh = -h
    phi_1 = math.expm1(hh)
    b1 = (phi_1 / hh - 1) / phi_1
    b2 = 2 * ((phi_1 / hh - 1) / hh - 0.5) / phi_1
    return phi_1, phi_1, b1, b2


def _unip(x: torch.Tensor, history: list[tuple[torch.Tensor, float]], sigma: float, sigma_next: float,
          order: int) -> torch.Tensor:
    """The predictor from ``x`` at ``sigma`` to ``sigma_next`` with the newest ``x0`` and, at order 2, the one
    before (its weight fixed at 1/2, as UniPC's order-2 predictor has it)."""
    m0, lam = history[-1]
    h = _lambda(sigma_next) - lam
    phi_1, scale, _, _ = _phi_terms(h)
    out = (sigma_next / sigma) * x - (1 - sigma_next) * phi_1 * m0
    if order == 2:
        m1, lam_1 = history[-2]
        r1 = (lam_1 - lam) / h
        out = out - (1 - sigma_next) * scale * 0.5 * (m1 - m0) / r1
    return out


def _unic(x: torch.Tensor, x0_new: torch.Tensor, history: list[tuple[torch.Tensor, float]], lam_new: float,
          sigma_before: float, sigma: float, order: int) -> torch.Tensor:
    """The corrector: the step from ``x`` at ``sigma_before`` to ``sigma`` taken again with ``x0_new`` (the
    prediction at ``sigma``) as well as the history the predictor used (order 1: the newest only; order 2: both),
    weights from UniPC's order conditions."""
    m0, lam = history[-1]
    h = lam_new - lam
    phi_1, scale, b1, b2 = _phi_terms(h)
    out = (sigma / sigma_before) * x - (1 - sigma) * phi_1 * m0
    if order == 1:
        return out - (1 - sigma) * scale * 0.5 * (x0_new - m0)
    m1, lam_1 = history[-2]
    r1 = (lam_1 - lam) / h
    # solve [[1, 1], [r1, 1]] @ (rho_1, rho_new) = (b1, b2)
    rho_1 = (b1 - b2) / (1 - r1)
    rho_new = b1 - rho_1
    return out - (1 - sigma) * scale * (rho_1 * (m1 - m0) / r1 + rho_new * (x0_new - m0))
