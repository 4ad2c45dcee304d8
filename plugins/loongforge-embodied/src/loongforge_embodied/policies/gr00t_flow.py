"""GR00T's flow-matching convention over action chunks: the same function names as
:mod:`~loongforge_embodied.policies.flow_matching` (Pi0's), with time running the other way.

Time ``t`` runs from noise (0) to data (1): ``x_t = (1 - t) * noise + t * actions`` and the model predicts the
velocity ``actions - noise``. Training draws ``s ~ Beta(1.5, 1)`` and sets ``t = (0.999 - s) / 0.999``, so noisy
times (small ``t``) are drawn most often, as Pi0's Beta time does from the other end. Note that ``t`` is not
clamped: ``s > 0.999`` (probability ~0.15%) gives ``t`` down to ``-0.001 / 0.999``, a chunk that is noise to
within a thousandth, exactly as GR00T draws it. The model sees ``t`` through :func:`timestep_buckets`
(``int(t * 1000)``), not the float. Inference integrates from ``t = 0`` to ``t = 1`` in a few Euler steps (GR00T
uses 4). Noise and the masked loss are the shared ones; every draw takes an explicit generator per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from loongforge_embodied.policies.flow_matching import masked_loss, sample_noise

__all__ = ["ALPHA", "BETA", "BUCKETS", "NOISE_S", "euler_sample", "masked_loss", "noisy_actions", "sample_noise",
           "sample_time", "timestep_buckets"]

#: GR00T's action head: s ~ Beta(ALPHA, BETA), t = (NOISE_S - s) / NOISE_S, model time int(t * BUCKETS).
ALPHA, BETA, NOISE_S, BUCKETS = 1.5, 1.0, 0.999, 1000


def sample_time(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(B,) times, one per generator (Beta(a, 1) has CDF ``x**a``, so ``u**(1/a)`` samples it exactly)."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    s = u ** (1.0 / ALPHA)
    return ((NOISE_S - s) / NOISE_S).float()


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, target)`` for (B, H, A) chunks at times (B,)."""
    tt = t[:, None, None]
    return (1.0 - tt) * noise + tt * actions, actions - noise


def timestep_buckets(t: torch.Tensor) -> torch.Tensor:
    """The integer timestep the model embeds: ``int(t * 1000)`` (truncated toward zero, as GR00T's ``.long()``)."""
    return (t.double() * BUCKETS).long()


def euler_sample(velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                 steps: int) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t)`` from ``t = 0`` (``noise``) to ``t = 1`` in ``steps`` equal Euler steps.

    Times are float64 so that :func:`timestep_buckets` of ``k / steps`` is GR00T's ``int(k / steps * 1000)``
    (float32 0.7 is 0.69999999, which would truncate to bucket 699).
    """
    x, dt = noise, 1.0 / steps
    for k in range(steps):
        t = torch.full((x.shape[0],), k / steps, dtype=torch.float64, device=x.device)
        x = x + dt * velocity_fn(x, t)
    return x
