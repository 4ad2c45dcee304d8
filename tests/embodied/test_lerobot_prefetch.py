"""Background prefetch yields exactly the synchronous batches, in a seeded order; ranks split the frames."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.prefetch import BatchPrefetcher, collate
from loongforge_embodied.data.synthetic import write_synthetic_dataset
from loongforge_embodied.data.video import ContainerCache


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root, _ = write_synthetic_dataset(tmp_path_factory.mktemp("v3"), version="v3.0")
    return LeRobotDataset(root, action_horizon=4)


def _assert_batches_equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key == "task":
                assert a[key] == b[key]
            else:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_prefetched_batches_equal_the_synchronous_loop(dataset):
    prefetcher = BatchPrefetcher(dataset, 5, seed=3, num_threads=2, depth=3)
    order = np.random.default_rng([3, 0]).permutation(len(dataset))
    expected = [collate([dataset[int(i)] for i in order[s:s + 5]]) for s in range(0, len(dataset), 5)]
    got = list(prefetcher)
    _assert_batches_equal(got, expected)
    assert [len(b["task"]) for b in got] == [5] * 7 + [2]
    assert got[0]["action"].shape == (5, 4, 3) and got[0]["observation.images.top"].shape == (5, 3, 16, 16)


def test_order_depends_on_seed_and_epoch_only(dataset):
    first = [b.tolist() for b in BatchPrefetcher(dataset, 4, seed=1).batch_indices()]
    assert first == [b.tolist() for b in BatchPrefetcher(dataset, 4, seed=1).batch_indices()]
    assert first != [b.tolist() for b in BatchPrefetcher(dataset, 4, seed=2).batch_indices()]
    later = BatchPrefetcher(dataset, 4, seed=1)
    later.set_epoch(1)
    assert first != [b.tolist() for b in later.batch_indices()]
    assert sorted(np.concatenate(later.batch_indices()).tolist()) == list(range(len(dataset)))


def test_ranks_get_disjoint_frames_that_cover_the_dataset(dataset):
    shards = [np.concatenate(BatchPrefetcher(dataset, 4, seed=0, rank=r, world_size=2).batch_indices())
              for r in range(2)]
    assert not set(shards[0].tolist()) & set(shards[1].tolist())
    assert sorted(np.concatenate(shards).tolist()) == list(range(len(dataset)))
    assert len(BatchPrefetcher(dataset, 4, drop_last=True, rank=1, world_size=2)) == 18 // 4


def test_stopping_early_and_pickling(dataset):
    prefetcher = BatchPrefetcher(dataset, 2, seed=0, depth=4)
    batches = iter(prefetcher)
    next(batches)
    second = next(batches)
    batches.close()  # cancels the batches loaded ahead and joins the threads
    np.testing.assert_array_equal(second["index"], prefetcher.batch_indices()[1])
    copy = pickle.loads(pickle.dumps(dataset))  # what a torch DataLoader worker receives
    _assert_batches_equal([collate([copy[7]])], [collate([dataset[7]])])


def test_torch_dataloader_workers_give_the_same_batches(dataset):
    """The alternative to threads: forked worker processes, fed the prefetcher's seeded batches. The parent has
    decoded and converted a frame first (PyAV keeps that thread's converter, which a forked worker inherits: with
    swscale threads of its own it waited forever for threads the fork did not copy); a worker that hangs fails the
    DataLoader's timeout instead of the suite."""
    from torch.utils.data import DataLoader

    dataset[0]  # the parent has a video open; forked workers must open their own
    prefetcher = BatchPrefetcher(dataset, 5, seed=3)
    batches = [b.tolist() for b in prefetcher.batch_indices()]
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=2, collate_fn=collate, timeout=120)
    _assert_batches_equal(list(loader), list(prefetcher))


def test_a_forked_process_does_not_reuse_the_parents_containers(dataset, monkeypatch):
    cache = ContainerCache()
    path = dataset.root / dataset.episodes[0].videos["observation.images.top"].path
    parent = cache.get(path)
    assert cache.get(path) is parent
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as seen from a forked child
    assert cache.get(path) is not parent
