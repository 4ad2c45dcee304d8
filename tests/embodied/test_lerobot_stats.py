"""Normalisation stats (shipped and computed) agree with numpy; the Normalizer maps as documented and inverts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.normalize import Normalizer
from loongforge_embodied.data.stats import aggregate_stats, compute_stats
from loongforge_embodied.data.synthetic import write_synthetic_dataset

KEYS = ("observation.state", "action")


@pytest.fixture(scope="module", params=["v2.1", "v3.0"])
def opened(request, tmp_path_factory):
    root, episodes = write_synthetic_dataset(tmp_path_factory.mktemp(request.param), version=request.param)
    truth = {key: np.concatenate([ep.features[key] for ep in episodes]).astype(np.float64) for key in KEYS}
    return request.param, LeRobotDataset(root), truth, episodes


def _numpy_stats(values):
    return {"min": values.min(0), "max": values.max(0), "mean": values.mean(0), "std": values.std(0),
            "q01": np.quantile(values, 0.01, axis=0), "q99": np.quantile(values, 0.99, axis=0)}


def test_computed_stats_equal_numpy(opened):
    _, dataset, truth, _ = opened
    computed = dataset.compute_stats()
    assert sorted(computed) == sorted(KEYS)
    for key in KEYS:
        for name, expected in _numpy_stats(truth[key]).items():
            np.testing.assert_allclose(computed[key][name], expected, rtol=1e-12, atol=1e-12, err_msg=f"{key} {name}")
        assert computed[key]["count"].tolist() == [37]


def test_shipped_stats_equal_numpy(opened):
    """v3.0 stats.json is exact; v2.1 merges per-episode stats: min/max/mean/std exact, quantiles approximate."""
    version, dataset, truth, episodes = opened
    for key in KEYS:
        expected = _numpy_stats(truth[key])
        exact = ("min", "max", "mean", "std", "q01", "q99") if version == "v3.0" else ("min", "max", "mean", "std")
        for name in exact:
            np.testing.assert_allclose(dataset.stats[key][name], expected[name], rtol=1e-10, atol=1e-12)
        assert dataset.stats[key]["count"].tolist() == [37]
    pixels = np.concatenate([ep.cameras["observation.images.top"] for ep in episodes]).reshape(-1, 3) / 255.0
    image = dataset.stats["observation.images.top"]
    assert image["mean"].shape == (3, 1, 1)
    np.testing.assert_allclose(image["mean"].reshape(3), pixels.mean(0), rtol=1e-10)
    np.testing.assert_allclose(image["std"].reshape(3), pixels.std(0), rtol=1e-10)


def test_aggregate_matches_whole_for_uneven_parts():
    values = np.random.default_rng(0).normal(size=(50, 3)) * [1.0, 5.0, 0.1] + [0.0, 2.0, -1.0]
    merged = aggregate_stats(compute_stats(part) for part in np.split(values, [7, 30]))
    whole = compute_stats(values)
    for name in ("min", "max", "mean", "std", "count"):
        np.testing.assert_allclose(merged[name], whole[name], rtol=1e-12)


def test_normalizer_modes_and_inverse(opened):
    _, dataset, truth, _ = opened
    stats = dataset.compute_stats()
    norm = Normalizer(stats, {"observation.state": "mean_std", "action": "quantiles", "index": "identity"})
    state = norm.normalize("observation.state", truth["observation.state"])
    np.testing.assert_allclose(state.mean(0), 0.0, atol=1e-9)
    np.testing.assert_allclose(state.std(0), 1.0, rtol=1e-6)
    ends = norm.normalize("action", np.stack([stats["action"]["q01"], stats["action"]["q99"]]))
    np.testing.assert_allclose(ends, [[-1.0] * 3, [1.0] * 3], atol=1e-6)
    batch = {key: truth[key].astype(np.float32) for key in KEYS} | {"index": np.arange(37), "task": "t"}
    normalised = norm(batch)
    assert normalised["index"] is batch["index"] and normalised["task"] == "t"
    assert normalised["action"].dtype == np.float32
    restored = norm.inverse(normalised)
    for key in KEYS:
        np.testing.assert_allclose(restored[key], batch[key], rtol=1e-5, atol=1e-6)
    actions = torch.from_numpy(batch["action"])
    np.testing.assert_allclose(norm.normalize("action", actions).numpy(), normalised["action"], rtol=1e-6)
    np.testing.assert_allclose(norm.unnormalize("action", norm.normalize("action", actions)), actions, atol=1e-6)


def test_min_max_and_constant_dimensions():
    values = np.array([[0.0, 3.0], [2.0, 3.0], [4.0, 3.0]])
    norm = Normalizer({"x": compute_stats(values)}, {"x": "min_max"})
    np.testing.assert_allclose(norm.normalize("x", values), [[-1, 0], [0, 0], [1, 0]], atol=1e-7)
    np.testing.assert_allclose(norm.unnormalize("x", norm.normalize("x", values)), values)


def test_normalizer_errors_name_the_feature():
    stats = {"action": {"mean": np.zeros(2), "std": np.ones(2)}}
    with pytest.raises(KeyError, match="stats of 'action' lack \\['q01', 'q99'\\]"):
        Normalizer(stats, {"action": "quantiles"})
    with pytest.raises(KeyError, match="no stats for 'observation.state'"):
        Normalizer(stats, {"observation.state": "mean_std"})
    with pytest.raises(ValueError, match="mode 'zscore' for 'action' is unknown"):
        Normalizer(stats, {"action": "zscore"})
