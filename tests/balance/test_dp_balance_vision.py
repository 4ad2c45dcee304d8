"""dp-balance sees what a video costs the vision encoder, not only its LLM tokens.

The "measured" time is a hand count of forward FLOPs of a Qwen2-VL-7B-shaped model (ViT: 32 layers of width 1280,
attention within each frame group; LLM: 28 layers of width 3584, causal attention), written out here from the
sizes, not from the cost model. A cost model fitted on per-rank times of that count (1% noise) ranks samples as the
count does, where the token-only fit puts a long video below a text sample of more tokens; and a batch of a long
video among short text samples, planned with the fitted cost, ends with a lower max/mean of the counted compute
across ranks than the token-only plan. The samples' ``encoder_work`` comes from loongforge-vlm's wire format and
reaches the plan through the gathered layout (a one-process gloo group).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from loongforge_balance.dp_balance import CostModel, evaluate, fit_cost_model, gather_layout, lpt_plan
from loongforge_vlm.data.balanced import encoder_work, to_wire
from loongforge_vlm.data.dataset import VisionSample

VIT_WIDTH, VIT_LAYERS, LLM_WIDTH, LLM_LAYERS = 1280, 32, 3584, 28
TEXT = 40  # text tokens around an image or video


def counted_flops(tokens: int, grids: list[tuple[int, int, int]]) -> float:
    """Forward FLOPs by hand: 24 * width**2 per token and layer for the dense parts (qkv, output, a 4x MLP: 2 flops
    per multiply-add), 4 * width per attended pair and layer (scores and the weighted sum); the LLM attends causally
    over the whole sample, the ViT within each frame group of h * w patches."""
    llm = LLM_LAYERS * (24 * LLM_WIDTH ** 2 * tokens + 4 * LLM_WIDTH * tokens * (tokens + 1) / 2)
    vit = sum(VIT_LAYERS * t * (24 * VIT_WIDTH ** 2 * h * w + 4 * VIT_WIDTH * (h * w) ** 2) for t, h, w in grids)
    return llm + vit


def sample(grids: list[tuple[int, int, int]], text: int, video: bool = False) -> VisionSample:
    """A sample with these image (or video) grids and ``text`` text tokens; ids sized as the dataset sizes them."""
    tokens = text + sum(t * h * w // 4 for t, h, w in grids)
    rows = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    none = np.zeros((0, 3), dtype=np.int64)
    return VisionSample(ids=np.zeros(tokens + 1, dtype=np.int64), supervised=np.ones(tokens + 1, dtype=bool),
                        pixel_values=np.zeros((0, 1), np.float32), image_grid_thw=none if video else rows,
                        pixel_values_videos=np.zeros((0, 1), np.float32), video_grid_thw=rows if video else none,
                        second_per_grid_ts=np.ones(len(grids) if video else 0, np.float32), where="synthetic")


def random_sample(rng: np.random.Generator) -> VisionSample:
    kind = rng.integers(3)
    if kind == 0:
        return sample([], int(rng.integers(100, 2000)))
    side = int(rng.integers(8, 40)) * 2
    if kind == 1:
        return sample([(1, side, side)], TEXT)
    return sample([(int(rng.integers(2, 24)), side, side)], TEXT, video=True)


def features(samples: list[VisionSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, encoder work and counted FLOPs of each sample."""
    tokens = np.array([len(s.ids) - 1 for s in samples])
    work = np.array([encoder_work(s) for s in samples]).reshape(-1, 2)
    flops = np.array([counted_flops(n, [tuple(g) for g in np.concatenate([s.image_grid_thw, s.video_grid_thw])])
                      for n, s in zip(tokens, samples, strict=True)])
    return tokens, work, flops


@pytest.fixture(scope="module")
def fitted():
    """The full and the token-only cost model fitted on 96 ranks' counted FLOPs (1% noise)."""
    rng = np.random.default_rng(0)
    ranks = [[random_sample(rng) for _ in range(int(rng.integers(1, 6)))] for _ in range(96)]
    measured = [features(r) for r in ranks]
    times = [flops.sum() * rng.normal(1, 0.01) / 1e12 for _, _, flops in measured]
    full = fit_cost_model([m[0] for m in measured], times, [m[1] for m in measured])
    tokens_only = fit_cost_model([m[0] for m in measured], times)
    return full, tokens_only


def test_encoder_work_counts_patches_and_per_frame_attention():
    video = sample([(6, 16, 24)], TEXT, video=True)
    both = sample([(1, 8, 8), (1, 4, 12)], TEXT)
    assert encoder_work(video) == (6 * 16 * 24, 6 * (16 * 24) ** 2)
    assert encoder_work(both) == (64 + 48, 64 ** 2 + 48 ** 2)
    assert encoder_work(sample([], 100)) == (0, 0)
    assert to_wire(3, video)["encoder_work"].tolist() == [6 * 16 * 24, 6 * (16 * 24) ** 2]


def test_fitted_cost_ranks_samples_as_the_counted_flops(fitted):
    full, tokens_only = fitted
    assert full.d > 0 and full.e > 0 and tokens_only.d == tokens_only.e == 0
    # a long video of fewer LLM tokens than the text sample, but more compute; an image; short text
    samples = [sample([], 1800), sample([(8, 24, 24)], TEXT, video=True), sample([(1, 48, 48)], TEXT),
               sample([], 300), sample([(16, 36, 36)], TEXT, video=True)]
    tokens, work, flops = features(samples)
    assert tokens[1] < tokens[0] and flops[1] > flops[0]
    truth = np.argsort(flops).tolist()
    assert np.argsort(full.costs(tokens, work)).tolist() == truth
    assert np.argsort(tokens_only.costs(tokens)).tolist() != truth
    assert np.allclose(full.costs(tokens, work), flops / 1e12, rtol=0.05)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_long_video_among_short_texts_is_balanced_by_its_true_cost(fitted, one_rank_group):
    full, tokens_only = fitted
    rng = np.random.default_rng(1)
    samples = [sample([(8, 40, 40)], TEXT, video=True)] + [sample([], int(n)) for n in rng.integers(200, 1500, 40)]
    layout = gather_layout([to_wire(i, s) for i, s in enumerate(samples)])
    tokens, work, flops = features(samples)
    assert np.array_equal(layout.lengths, tokens) and np.array_equal(layout.encoder, work)
    ranks = 4

    def counted_imbalance(model: CostModel, encoder: np.ndarray | None) -> float:
        plan = lpt_plan(model.costs(layout.lengths, encoder), layout.lengths, ranks)
        return evaluate(plan.ranks, flops, layout.lengths, ranks).imbalance

    with_vision = counted_imbalance(full, layout.encoder)
    token_only = counted_imbalance(tokens_only, None)
    assert with_vision < 1.02 and token_only > 1.1
    assert torch.equal(torch.tensor(layout.encoder[0]), to_wire(0, samples[0])["encoder_work"])
