"""A tiny Wan DiT learns moving squares on CPU: the flow-matching loss falls within 100 steps."""

from __future__ import annotations

import pytest
import torch
from loongforge_diffusion.flow_matching import FlowMatchingConfig
from loongforge_diffusion.task import DiffusionTask
from loongforge_diffusion.training import flow_matching_step, token_timesteps
from loongforge_diffusion.wan.flavors import FLAVORS
from torch.utils.data import DataLoader


def _train(task: DiffusionTask, model, steps: int) -> list[float]:
    loader = DataLoader(task.build_dataset(length=256, text_dim=model.flavor.text_dim), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(0), drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            loss = task.training_step(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def test_loss_falls_on_moving_squares():
    torch.manual_seed(0)
    task = DiffusionTask(objective=FlowMatchingConfig(), context_dropout=0.1, seed=0)
    model = task.build_model("wan-tiny")
    losses = _train(task, model, 100)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first == pytest.approx(1.45, abs=0.2)  # zero head: E|eps - x0|^2 with x0 mostly -1
    assert last < 0.5 * first
    video = task.sample(model, {"context": task.build_dataset(length=2, text_dim=32)[0]["context"][None]}, steps=4,
                        shape=(1, 3, 4, 16, 16), guidance=2.0)
    assert video.shape == (1, 3, 4, 16, 16) and torch.isfinite(video).all()


def test_step_is_reproducible_and_registry_names_resolve():
    model = DiffusionTask().build_model("wan-tiny", num_layers=1)
    batch = DiffusionTask().build_dataset(length=2, text_dim=32)[0]
    batch = {k: v[None] for k, v in batch.items()}
    losses = [flow_matching_step(model, batch, torch.Generator().manual_seed(5)).item() for _ in range(2)]
    assert losses[0] == losses[1] and model.flavor.num_layers == 1


def test_clean_first_frame_uses_per_token_timesteps():
    sigma = torch.tensor([0.5, 0.25])
    timesteps = token_timesteps(sigma, (3, 2, 2), clean_frames=1)
    assert timesteps.tolist() == [[0.0] * 4 + [500.0] * 8, [0.0] * 4 + [250.0] * 8]
    flavor = FLAVORS["wan-tiny"].with_overrides(task="ti2v", per_token_timesteps=True, num_layers=1)
    task = DiffusionTask(seed=1)
    model = task.build_model(flavor)
    batch = {"video": torch.randn(2, 3, 3, 4, 4), "context": torch.randn(2, 3, 32)}
    loss = task.training_step(model, batch)
    # The zero-initialised head predicts 0, so the loss is E|eps - x0|^2 over the noisy frames only.
    generator = torch.Generator().manual_seed(1)
    torch.rand(2, generator=generator, dtype=torch.float64)
    noise = torch.randn(batch["video"].shape, generator=generator)
    expected = ((noise - batch["video"])[:, :, 1:] ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
