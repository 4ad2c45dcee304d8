"""The moving-squares generator draws what its labels say, and the shipped scorer tells that from noise."""

from __future__ import annotations

import torch
from loongforge.cli import main
from loongforge_diffusion.data.moving_squares import (
    PALETTE,
    SIZES,
    Geometry,
    MovingSquares,
    TensorVideoDataset,
    caption,
    render,
)
from loongforge_diffusion.scoring import score_video, score_videos


def test_samples_are_reproducible_and_well_formed():
    dataset = MovingSquares(64, text_dim=8, seed=3)
    first, again = dataset[5], MovingSquares(64, text_dim=8, seed=3)[5]
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert first["video"].shape == (3, 4, 16, 16) and first["context"].shape == (3, 8)
    for index in range(len(dataset)):
        sample = dataset[index]
        size = SIZES[int(sample["labels"][2])]
        foreground = (sample["video"].max(dim=0).values > 0).flatten(1).sum(dim=1)
        assert foreground.tolist() == [size * size] * 4  # the whole square is inside every frame
    labels = torch.stack([dataset[i]["labels"] for i in range(64)])
    assert all(len(labels[:, k].unique()) == n for k, n in enumerate((6, 4, 3)))  # every choice occurs


def test_render_moves_by_speed():
    video = render(torch.tensor([0, 0, 1]), (2, 3), Geometry(frames=3, side=16, speed=2))  # red, right, size 4
    assert torch.equal(video[:, 2, 2, 7], torch.tensor(PALETTE["red"]))  # left edge moved 3 -> 7
    assert video[:, 2, 2, 6].tolist() == [-1.0, -1.0, -1.0]
    assert caption(torch.tensor([0, 0, 1])) == "a red square of size 4 moving right"


def test_scorer_gives_one_on_ground_truth():
    dataset = MovingSquares(48, text_dim=8, seed=1)
    videos = torch.stack([dataset[i]["video"] for i in range(48)])
    labels = torch.stack([dataset[i]["labels"] for i in range(48)])
    assert score_videos(videos, labels) == {"colour": 1.0, "direction": 1.0, "square": 1.0}


def test_scorer_is_low_on_noise_and_on_wrong_answers():
    dataset = MovingSquares(48, text_dim=8, seed=1)
    labels = torch.stack([dataset[i]["labels"] for i in range(48)])
    noise = torch.randn(48, 3, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    scores = score_videos(noise, labels)
    assert scores["colour"] < 0.35 and scores["direction"] < 0.45 and scores["square"] < 0.1
    sample = dataset[0]
    wrong_colour = sample["labels"].clone()
    wrong_colour[0] = (wrong_colour[0] + 1) % 6
    assert score_video(sample["video"], wrong_colour)["colour"] == 0.0
    reversed_video = sample["video"].flip(1)  # frames backwards: the opposite direction
    assert score_video(reversed_video, sample["labels"])["direction"] == 0.0
    still = sample["video"][:, :1].expand(-1, 4, -1, -1)
    assert score_video(still, sample["labels"])["direction"] == 0.0
    assert score_video(torch.full((3, 4, 16, 16), -1.0), sample["labels"]) == {"colour": 0.0, "direction": 0.0,
                                                                                "square": 0.0}


def test_command_writes_a_dataset_that_reads_back(tmp_path):
    out = tmp_path / "squares.pt"
    assert main(["make-data", "moving-squares", str(out), "--count", "6", "--seed", "2", "--text-dim", "8",
                 "--frames", "3"]) == 0
    written, generated = TensorVideoDataset(out), MovingSquares(6, text_dim=8, seed=2, geometry=Geometry(frames=3))
    assert len(written) == 6 and written.geometry == Geometry(frames=3)
    assert all(torch.equal(written[i][k], generated[i][k]) for i in range(6) for k in ("video", "context", "labels"))
