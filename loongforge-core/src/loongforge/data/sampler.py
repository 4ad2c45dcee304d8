"""Deterministic, resumable batch order for training, and in-order batches for evaluation.

Why not a ``DataLoader`` with a ``RandomSampler``: resuming must reproduce the exact batches an
uninterrupted run would have seen, including across epoch boundaries and with several data-parallel ranks.
Here the whole order is a pure function of ``(seed, epoch)``, so the only state is one integer, the number
of samples consumed by all ranks together (Megatron's ``consumed_samples``), which goes in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loongforge.data.errors import DataError
from loongforge.data.gpt_dataset import GPTSampleDataset


class TrainBatchIterator:
    """Endless micro-batches of this rank, reshuffled every epoch.

    Each step consumes a global batch of ``micro_batch_size * dp_size`` samples from the stream
    ``perm(seed, 0) ++ perm(seed, 1) ++ ...`` (a permutation of the dataset per epoch); rank ``r`` gets the
    ``r``-th slice of it. A batch may straddle two epochs; that too is deterministic.
    """

    def __init__(
        self,
        dataset: GPTSampleDataset,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start_sample: int = 0,
    ) -> None:
        if len(dataset) == 0:
            raise DataError(f"{dataset.tokens.prefix}: no training samples ({dataset.tokens.num_tokens} tokens, "
                            f"seq_length {dataset.seq_length}); use more text or a shorter seq_length")
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size or start_sample < 0:
            raise DataError(f"bad batch layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                            f"dp_size={dp_size}, start_sample={start_sample}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = start_sample
        self._cached_epoch = -1
        self._cached_perm = np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // len(self.dataset)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            self._cached_perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._cached_epoch = epoch
        return self._cached_perm

    def sample_indices(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices at the given positions of the endless shuffled stream."""
        n = len(self.dataset)
        epochs, offsets = np.divmod(positions, n)
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            indices[chosen] = self._permutation(int(epoch))[offsets[chosen]]
        return indices

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        positions = np.arange(first, first + self.micro_batch_size, dtype=np.int64)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return self.dataset.batch(self.sample_indices(positions))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must store to resume this exact order (valid for any ``dp_size``)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint; refuses state from another seed or dataset (the order would differ)."""
        if state["seed"] != self.seed or state["num_samples"] != len(self.dataset):
            raise DataError(
                f"cannot resume the data order: checkpoint has seed {state['seed']} over {state['num_samples']} "
                f"samples, this run has seed {self.seed} over {len(self.dataset)} samples"
            )
        self.consumed_samples = int(state["consumed_samples"])


def eval_batches(
    dataset: GPTSampleDataset, micro_batch_size: int, *, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """One in-order pass; each rank gets its slice of every full global batch.

    The last partial global batch is dropped so that all ranks run the same number of steps (a rank
    waiting on a collective that another rank skipped would hang).
    """
    global_batch = micro_batch_size * dp_size
    for start in range(0, len(dataset) - global_batch + 1, global_batch):
        first = start + dp_rank * micro_batch_size
        yield dataset.batch(np.arange(first, first + micro_batch_size, dtype=np.int64))
