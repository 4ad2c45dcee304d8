"""Batches of a map-style dataset in a seeded order, loaded ahead by background threads.

Threads, not torch DataLoader worker processes, because the expensive parts of a LeRobot item (PyAV video
decoding, parquet reads) run in C with the GIL released, so threads overlap them with training at no cost of
forking, pickling the dataset or re-opening videos in every worker; the batches come back in exactly the
order of the synchronous loop, whatever the thread timing. The dataset stays usable with a torch DataLoader
too (it pickles without its open video files, and forked workers open their own); pass
``batch_sampler=prefetcher.batch_indices()`` and ``collate_fn=collate`` for the same batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np


def collate(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack the items' arrays and numbers along a new first axis; strings (task text) stay a list."""
    batch = {}
    for key, first in items[0].items():
        values = [item[key] for item in items]
        batch[key] = values if isinstance(first, str) else np.stack(values)
    return batch


class BatchPrefetcher:
    """Iterate batches of ``dataset``; ``depth`` batches are loaded ahead by ``num_threads`` threads.

    The order is a permutation drawn from ``seed`` and the epoch (:meth:`set_epoch`), split across
    ``world_size`` data-parallel ranks (each rank takes every ``world_size``-th index), so a run is
    reproducible and ranks see disjoint frames.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_threads: int = 2,
        depth: int = 4,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable[[Sequence[dict[str, Any]]], Any] = collate,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dataset, self.batch_size = dataset, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.num_threads, self.depth = num_threads, max(1, depth)
        self.rank, self.world_size = rank, world_size
        self.collate_fn = collate_fn
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batch_indices(self) -> list[np.ndarray]:
        """The index batches of the current epoch for this rank, in iteration order."""
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        order = order[self.rank::self.world_size]
        stop = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
        return [order[i:i + self.batch_size] for i in range(0, stop, self.batch_size)]

    def __len__(self) -> int:
        return len(self.batch_indices())

    def load(self, indices: Sequence[int]) -> Any:
        """One batch, loaded in the calling thread."""
        return self.collate_fn([self.dataset[int(i)] for i in indices])

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.batch_indices())
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.num_threads, thread_name_prefix="lerobot-prefetch") as pool:
            try:
                for indices in batches:
                    pending.append(pool.submit(self.load, indices))
                    if len(pending) >= self.depth:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()
