"""Chat samples -> fixed-length training rows, one conversation per row (padded) or several per row (packed).

Why packing: chat samples are short and vary in length, so padding each to ``seq_length`` wastes most of the
compute. A packed row holds several conversations back to back; for it to train exactly as the separate
samples would, each token must see only earlier tokens *of its own conversation*:

* the batch carries the sequence boundaries, ``cu_seqlens`` (over the micro-batch's tokens flattened row by row;
  padding at the end of a row is a sequence of its own), and attention runs on each sequence alone
  (:mod:`loongforge.parallel.packed_rows`); attention that cannot do that gets the same rule as a dense
  block-diagonal causal mask (:func:`block_causal_mask`, megatron convention ``[b, 1, s, s]``, ``True`` = masked
  out), built only then, as it costs ``s * s`` per row;
* ``position_ids`` restart at 0 for each conversation. megatron's RoPE derives rotations from the row index
  rather than from ``position_ids``, but RoPE scores depend only on the *distance* between two positions, and
  within a block that distance is the same as in the unpacked sample, so the result is the same (the packing
  test checks the loss to 1e-5).

Rows are filled best-fit in dataset order (each sample goes to the fullest row it still fits in), so the
packing is a pure function of the data and ``seq_length``, and resuming replays the same rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from loongforge.data.errors import DataError
from loongforge.data.sft import ChatSample

if TYPE_CHECKING:  # torch is imported when a batch is made: ``check`` sizes the rows without it
    import torch


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sample indices per row so that each row's total length is at most ``capacity`` (best fit)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted
    for index, length in enumerate(lengths):
        if length > capacity:
            raise DataError(f"sample {index} has {length} tokens, more than a row holds ({capacity})")
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, row = free.pop(slot)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if space - length > 0:
            bisect.insort(free, (space - length, row))
    return rows


class ChatRowDataset:
    """Training rows of ``seq_length`` tokens built from chat samples; ``ds.batch(indices)`` is a micro-batch.

    Each sample is cut to ``seq_length + 1`` ids (inputs are ``ids[:-1]``, labels ``ids[1:]``, and a label is a
    target when it is a reply token). ``rows`` lists the samples of each row: one each when not packed.
    Batches have the keys of a pre-training batch, plus ``cu_seqlens`` when packed.
    """

    def __init__(self, samples: Sequence[ChatSample], seq_length: int, pad_id: int, *, pack: bool) -> None:
        if seq_length < 1:
            raise DataError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.pack = pack
        self.samples = [ChatSample(s.ids[: seq_length + 1], s.supervised[: seq_length + 1]) for s in samples]
        lengths = [len(s.ids) - 1 for s in self.samples]
        self.rows = pack_rows(lengths, seq_length) if pack else [[i] for i in range(len(self.samples))]

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """``tokens``, ``labels``, ``position_ids`` (int64), ``loss_mask`` (float32) [b, s]; packed rows add
        ``cu_seqlens`` (int32, :func:`sequence_boundaries`)."""
        import torch

        b, s = len(indices), self.seq_length
        tokens = np.full((b, s), self.pad_id, dtype=np.int64)
        labels = np.full((b, s), self.pad_id, dtype=np.int64)
        loss_mask = np.zeros((b, s), dtype=np.float32)
        positions = np.tile(np.arange(s, dtype=np.int64), (b, 1))
        segments = np.full((b, s), -1, dtype=np.int64)
        for r, row in enumerate(np.asarray(indices, dtype=np.int64)):
            start = 0
            for k, sample_index in enumerate(self.rows[row]):
                sample = self.samples[sample_index]
                n = len(sample.ids) - 1
                tokens[r, start : start + n] = sample.ids[:-1]
                labels[r, start : start + n] = sample.ids[1:]
                loss_mask[r, start : start + n] = sample.supervised[1:]
                positions[r, start : start + n] = np.arange(n)
                segments[r, start : start + n] = k
                start += n
            positions[r, start:] = np.arange(s - start)
        batch = {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(positions),
        }
        if self.pack:
            batch["cu_seqlens"] = torch.tensor(sequence_boundaries(segments), dtype=torch.int32)
        return batch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.batch(np.asarray([index])).items()}


def sequence_boundaries(segments: np.ndarray) -> list[int]:
    """``cu_seqlens`` of ``[b, s]`` rows whose tokens carry their sample's index in the row (``-1``: padding): where
    a sample starts or ends over the rows flattened one after another, every row end included (a padding tail is a
    sequence of its own)."""
    rows, length = segments.shape
    change = np.ones((rows, length), dtype=bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return [*np.flatnonzero(change).tolist(), rows * length]


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where query ``i`` may not attend key ``j``: ``j > i`` or another segment."""
    import torch

    s = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return ~(same & causal).unsqueeze(1)
