"""Flow-matching objective and Euler sampler, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from loongforge.errors import ConfigError
from loongforge_diffusion.flow_matching import (
    FlowMatchingConfig,
    expert_sigma_range,
    interpolate,
    loss_weight,
    sample_sigmas,
    shift_sigma,
    unshift_sigma,
    velocity_target,
)
from loongforge_diffusion.sampling import euler_sample, guided, sigma_schedule, switch_experts


def test_shift_formula_values_and_inverse():
    assert shift_sigma(0.5, 3.0) == pytest.approx(0.75)  # 1.5 / 2
    assert shift_sigma(0.25, 5.0) == pytest.approx(1.25 / 2.0)
    assert shift_sigma(0.0, 12.0) == 0.0 and shift_sigma(1.0, 12.0) == 1.0
    assert shift_sigma(0.3, 1.0) == pytest.approx(0.3)
    sigmas = torch.linspace(0, 1, 11, dtype=torch.float64)
    assert torch.allclose(unshift_sigma(shift_sigma(sigmas, 5.0), 5.0), sigmas, atol=1e-12)


def test_interpolation_and_target():
    x0, noise = torch.full((2, 1, 1, 1, 1), 2.0), torch.full((2, 1, 1, 1, 1), -1.0)
    x_t = interpolate(x0, noise, torch.tensor([0.0, 0.25]))
    assert x_t.flatten().tolist() == [2.0, 0.75 * 2.0 + 0.25 * -1.0]
    assert velocity_target(x0, noise).flatten().tolist() == [-3.0, -3.0]


@pytest.mark.parametrize("sampling", ["uniform", "logit-normal"])
def test_sigmas_stay_in_the_expert_range(sampling):
    generator = torch.Generator().manual_seed(0)
    for expert in ("high", "low"):
        low, high = expert_sigma_range(0.875, expert)
        config = FlowMatchingConfig(shift=12.0, sampling=sampling, sigma_range=(low, high))
        sigmas = sample_sigmas(20000, config, generator)
        assert sigmas.min() >= low - 1e-6 and sigmas.max() < high + 1e-6
        assert sigmas.max() - sigmas.min() > 0.5 * (high - low)  # spread over the range, not stuck at an end


def test_uniform_sampling_with_shift_has_the_shifted_distribution():
    # With uniform u and shift k, P(sigma < shift(q)) = q for any q.
    sigmas = sample_sigmas(40000, FlowMatchingConfig(shift=3.0), torch.Generator().manual_seed(1))
    for q in (0.1, 0.5, 0.9):
        assert (sigmas < shift_sigma(q, 3.0)).float().mean().item() == pytest.approx(q, abs=0.01)


def test_logit_normal_median_and_restriction():
    generator = torch.Generator().manual_seed(2)
    sigmas = sample_sigmas(40000, FlowMatchingConfig(sampling="logit-normal", logit_mean=1.0), generator)
    assert sigmas.median().item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.01)
    # Restricted to [0.5, 1): the conditional median of sigmoid(N(0, 1)) above 0.5 is sigmoid(0.6745).
    restricted = sample_sigmas(40000, FlowMatchingConfig(sampling="logit-normal", sigma_range=(0.5, 1.0)), generator)
    assert restricted.median().item() == pytest.approx(1 / (1 + math.exp(-0.6745)), abs=0.01)


def test_loss_weights():
    sigma = torch.tensor([0.0, 0.5, 1.0])
    assert loss_weight(sigma, "none").tolist() == [1.0, 1.0, 1.0]
    assert loss_weight(sigma, "cosmap").tolist() == pytest.approx([2 / math.pi, 4 / math.pi, 2 / math.pi])
    with pytest.raises(ConfigError):
        FlowMatchingConfig(weighting="bogus")
    with pytest.raises(ConfigError):
        FlowMatchingConfig(sigma_range=(0.9, 0.2))


def test_schedule_values():
    assert sigma_schedule(4) == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sigma_schedule(2, shift=3.0) == pytest.approx([1.0, 0.75, 0.0])


@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_euler_integrates_the_straight_path_exactly(shift):
    # On the path x_s = (1 - s) c + s eps the velocity is (x - c) / s; Euler lands on c exactly from any noise.
    target = torch.tensor([[0.5, -2.0, 3.0]])
    noise = torch.randn(1, 3, generator=torch.Generator().manual_seed(3))
    out = euler_sample(lambda x, s: (x - target) / s, noise, sigma_schedule(7, shift))
    assert torch.allclose(out, target, atol=1e-6)


def test_euler_with_constant_velocity_moves_by_it():
    out = euler_sample(lambda x, s: torch.full_like(x, 2.0), torch.zeros(4), sigma_schedule(3))
    assert out.tolist() == [-2.0] * 4


def test_guidance_and_expert_switch():
    cond, uncond = (lambda x, s: x + 1), (lambda x, s: x)
    assert guided(cond, uncond, 4.0)(torch.zeros(1), 0.5).item() == 4.0
    velocity = switch_experts(lambda x, s: torch.ones(1), lambda x, s: -torch.ones(1), boundary=0.875)
    assert [velocity(None, s).item() for s in (1.0, 0.875, 0.5)] == [1.0, 1.0, -1.0]
