"""UniPC and DPM-Solver++(2M) (``task.sample.sampler``, ``loongforge sample --sampler``) step for step against
diffusers' ``UniPCMultistepScheduler`` / ``DPMSolverMultistepScheduler`` in their flow-matching configuration (what
diffusers' Wan pipelines use): the same noise levels, and the same latents after every step count from 1 to 20 and
shifts 1 to 5, the velocity being a tiny Wan DiT with weights drawn away from init. A wrong order, a corrector left
out or a schedule off by a step parts from diffusers by far more than the 1e-5 allowed."""

from __future__ import annotations

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler
from loongforge.cli import main
from loongforge_diffusion.multistep import dpm_solver_pp_sample, dpm_solver_sigmas, unipc_sample, unipc_sigmas
from loongforge_diffusion.sampling import integrate
from loongforge_diffusion.task import DiffusionTask

SOLVERS = {"unipc": (UniPCMultistepScheduler, unipc_sample, unipc_sigmas),
           "dpm++": (DPMSolverMultistepScheduler, dpm_solver_pp_sample, dpm_solver_sigmas)}


@pytest.fixture(scope="module")
def velocity():
    """A tiny Wan DiT (weights perturbed: its zero-initialised head would predict nothing) conditioned on a caption."""
    torch.manual_seed(0)
    task = DiffusionTask(seed=0)
    model = task.build_model("wan-tiny", num_layers=2).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    context = torch.randn(1, 6, model.flavor.text_dim)

    def predict(x: torch.Tensor, sigma: float) -> torch.Tensor:
        with torch.no_grad():
            return model(x, torch.full((1,), sigma * 1000.0), context)
    return predict


def _diffusers(scheduler_class, velocity, noise: torch.Tensor, steps: int, shift: float):
    scheduler = scheduler_class(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)
    scheduler.set_timesteps(steps)
    x = noise.clone()
    for i, timestep in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, float(scheduler.sigmas[i])), timestep, x).prev_sample
    return x, scheduler.sigmas.tolist()


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize(("steps", "shift"), [(20, 5.0), (20, 1.0), (7, 3.0), (2, 3.0), (1, 3.0)])
def test_latents_equal_diffusers_schedulers(velocity, solver, steps, shift):
    scheduler_class, sample, sigmas = SOLVERS[solver]
    noise = torch.randn((1, 3, 4, 16, 16), generator=torch.Generator().manual_seed(steps))
    expected, expected_sigmas = _diffusers(scheduler_class, velocity, noise, steps, shift)
    assert sigmas(steps, shift) == pytest.approx(expected_sigmas, abs=1e-6)
    seen: list[int] = []
    ours = sample(velocity, noise.clone(), sigmas(steps, shift), on_step=seen.append)
    assert seen == list(range(1, steps + 1))
    scale = expected.abs().max().item()
    assert (ours - expected).abs().max().item() <= 1e-5 * scale
    if steps == 20:  # and a multistep solver is not Euler: 20 steps of each land measurably apart
        euler = integrate(velocity, noise.clone(), steps, shift=shift, sampler="euler")
        assert (euler - expected).abs().max().item() > 1e-3 * scale


def test_an_unknown_sampler_is_one_line(capsys, tmp_path):
    config = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs/diffusion-moving-squares.yaml")
    assert main(["check", config, "task.sample.sampler=heun", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task.sample.sampler must be one of euler, unipc, dpm++, got 'heun'" in err, err
