"""Wan 2.2 A14B: two DiTs of one shape, a *high-noise* expert for ``sigma >= boundary`` and a *low-noise* expert for
the rest, as one module.

Why one module: the run trains, checkpoints, averages (EMA), samples and exports both experts as one model, so
``loongforge train`` / ``sample`` / ``convert`` need no notion of experts. The forward routes each sample to the
expert that owns its noise level, so sampling switches at the boundary by itself and a mixed batch (validation)
is exact; training draws one expert per step (:func:`choose_expert`) so each optimizer step touches only that
expert -- the other's gradients stay ``None`` and AdamW leaves its weights and moments alone.

Checkpoints hold ``high.*`` and ``low.*``. Released weights come as two directories: ``transformer/`` (high) and
``transformer_2/`` (low) in diffusers' pipeline folder, ``high_noise_model/`` and ``low_noise_model/`` in Wan-AI's
original release (:func:`expert_directories`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import LoongForgeError
from loongforge.tasks import sample_seed
from torch import nn

from loongforge_diffusion.flow_matching import NUM_TRAIN_TIMESTEPS, FlowMatchingConfig, sigma_mass
from loongforge_diffusion.wan.flavors import WanFlavor
from loongforge_diffusion.wan.model import WanModel

#: The experts, in the order checkpoints and exports list them: high noise first, as diffusers' ``transformer``.
EXPERTS = ("high", "low")
#: Each expert's subdirectory in a released pipeline, per layout: diffusers' pipeline folder, Wan-AI's release.
RELEASED_DIRECTORIES = {
    "diffusers": {"high": "transformer", "low": "transformer_2"},
    "original": {"high": "high_noise_model", "low": "low_noise_model"},
}
#: The dataset index :func:`choose_expert` seeds its draw with: no sample has it, so the draw is a stream of its own.
_EXPERT_DRAW_INDEX = -1


class WanExperts(nn.Module):
    """The two experts of a flavor with ``expert_boundary``; called like a :class:`WanModel`."""

    def __init__(self, flavor: WanFlavor, *, recompute: bool = False) -> None:
        super().__init__()
        if flavor.expert_boundary is None:
            raise LoongForgeError("WanExperts needs a flavor with expert_boundary (Wan 2.2 A14B)")
        self.flavor = flavor
        self.high = WanModel(flavor, recompute=recompute)
        self.low = WanModel(flavor, recompute=recompute)

    @property
    def boundary_timestep(self) -> float:
        """The timestep from which the high-noise expert serves (diffusers' ``boundary_ratio * 1000``)."""
        return self.flavor.expert_boundary * NUM_TRAIN_TIMESTEPS

    def expert(self, name: str) -> WanModel:
        return self.high if name == "high" else self.low

    def forward(self, video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                image_context: torch.Tensor | None = None, *, cp: Any = None) -> torch.Tensor:
        """Each sample through the expert of its timestep ``(B,)``; a batch on one side of the boundary is one call
        of that expert (bitwise what the expert alone gives), a mixed one is split and put back in order."""
        if timestep.ndim != 1:
            raise LoongForgeError("Wan 2.2 experts take one timestep per sample (per-token timesteps are TI2V's)")
        high = timestep >= self.boundary_timestep
        if bool(high.all()) or not bool(high.any()):
            return self.expert("high" if bool(high.all()) else "low")(video, timestep, context, image_context, cp=cp)
        parts, order = [], []
        for name, chosen in (("high", high), ("low", ~high)):
            rows = chosen.nonzero().flatten()
            inputs = [None if t is None else t.index_select(0, rows) for t in (video, timestep, context, image_context)]
            parts.append(self.expert(name)(*inputs, cp=cp))
            order.append(rows)
        return torch.cat(parts).index_select(0, torch.cat(order).argsort())


def choose_expert(objective: FlowMatchingConfig, boundary: float, seed: int,
                  step: int) -> tuple[str, FlowMatchingConfig]:
    """The expert that trains step ``step`` and the objective restricted to its noise levels.

    The expert is drawn with the probability the objective gives its noise levels, then the step's levels are drawn
    within its range: the noise levels each sample sees over a run are distributed exactly as without experts, and
    one whole step (every sample, every data-parallel rank: the draw depends on ``(seed, step)`` only) trains one
    expert. A ``sigma_range`` inside one expert's levels trains that expert alone (Wan-AI trains the experts in
    separate runs; this is how one run does it).
    """
    ranges = _expert_ranges(objective, boundary)
    masses = {name: sigma_mass(objective, *bounds) if bounds[0] < bounds[1] else 0.0
              for name, bounds in ranges.items()}
    generator = torch.Generator().manual_seed(sample_seed(seed, step, _EXPERT_DRAW_INDEX))
    draw = float(torch.rand((), generator=generator, dtype=torch.float64))
    name = "high" if draw * (masses["high"] + masses["low"]) < masses["high"] else "low"
    return name, replace(objective, sigma_range=ranges[name])


def choose_grouped_expert(objective: FlowMatchingConfig, boundary: float, seed: int, step: int,
                          window: int) -> tuple[str, FlowMatchingConfig]:
    """:func:`choose_expert` with the steps grouped by expert in windows of ``window`` steps (``task.expert_window``).

    Each window trains each expert on as many steps as the steps' own draws give it, the high expert's steps first in
    the 1st, 3rd, ... window and last in the others, so the expert changes at most once per window (and not at the
    border between windows): a one-resident run (``task.experts_resident: one``) swaps at most once per window. Over a
    window the experts are trained exactly as often as without grouping; only the order inside it changes. A pure
    function of ``(seed, step)``, so resume and data-parallel ranks agree."""
    if window == 1:
        return choose_expert(objective, boundary, seed, step)
    number, position = divmod(step - 1, window)
    first = number * window + 1
    high = sum(choose_expert(objective, boundary, seed, s)[0] == "high" for s in range(first, first + window))
    if number % 2 == 0:
        name = "high" if position < high else "low"
    else:
        name = "low" if position < window - high else "high"
    return name, replace(objective, sigma_range=_expert_ranges(objective, boundary)[name])


def _expert_ranges(objective: FlowMatchingConfig, boundary: float) -> dict[str, tuple[float, float]]:
    """Each expert's part of the objective's noise levels."""
    low, high = objective.sigma_range
    return {"high": (max(low, boundary), high), "low": (low, min(high, below(boundary)))}


def below(boundary: float) -> float:
    """The largest float32 noise level under ``boundary``: the low expert's levels end there, so that no level drawn
    for it rounds (levels and timesteps are float32) up to the boundary, where the high expert takes over."""
    edge = torch.tensor(boundary, dtype=torch.float32)
    return float(torch.nextafter(edge, torch.zeros_like(edge)))


def expert_directories(path: str | Path) -> dict[str, Path]:
    """``{"high": dir, "low": dir}``: the two expert subdirectories of a released Wan 2.2 A14B folder (diffusers'
    pipeline or Wan-AI's original layout), or an error naming what each layout would hold."""
    root = Path(path).expanduser()
    for names in RELEASED_DIRECTORIES.values():
        found = {expert: root / sub for expert, sub in names.items()}
        if all(directory.is_dir() for directory in found.values()):
            return found
    wanted = " or ".join(" + ".join(f"{sub}/" for sub in names.values()) for names in RELEASED_DIRECTORIES.values())
    raise LoongForgeError(f"{root}: a two-expert (Wan 2.2 A14B) init needs the experts' folders {wanted}, or a "
                          "LoongForge checkpoint of a two-expert run")


def expert_state_dict(path: str | Path, read: Any) -> dict[str, Any]:
    """Both experts' tensors under ``high.`` / ``low.`` from a released folder; ``read(directory)`` gives one
    expert's tensors (or shapes) in our names."""
    return {f"{expert}.{name}": value for expert, directory in expert_directories(path).items()
            for name, value in read(directory).items()}
