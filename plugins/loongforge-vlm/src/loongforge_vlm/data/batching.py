"""Image-text samples -> fixed-length training rows (one sample each, or packed) and the batch dict the model reads.

Packing follows core's chat packing (:mod:`loongforge.data.packing`, whose ``pack_rows`` places the samples:
best fit in dataset order, so the rows are a pure function of the data): each sample keeps its own segment,
``position_ids`` restart at 0 per sample and ``cu_seqlens`` holds the sample boundaries, along which the trainer
attends packed rows sample by sample (:mod:`loongforge.parallel.packed_rows`). The
multimodal part: every row's images are concatenated in token order (row by row, sample by sample, image by
image), so the ``k``-th run of image pad tokens in ``tokens.flatten()`` belongs to ``image_grid_thw[k]``.
A sample longer than a row is cut only when no vision token would be cut (its images stay whole); otherwise it
is skipped and counted like any other bad sample.

Batch keys (``b`` rows of ``s`` tokens): ``tokens``, ``labels``, ``position_ids``, ``segment_ids`` (sample index
inside the row, -1 for padding) int64 ``[b, s]``; ``loss_mask`` float32 ``[b, s]``; ``cu_seqlens`` int32: the
sample boundaries over the flattened ``b * s`` tokens (padding tails are segments too), for varlen attention
(a model called directly on packed rows takes ``PackedRows.from_cu_seqlens(...)`` as ``packed_seq_params``, or
its ``dense_mask()`` as ``attention_mask``). When the batch has images:
``pixel_values`` float32 (Qwen: ``[patches, patch_dim]``; fixed-size towers: ``[images, C, S, S]``) and
``image_grid_thw`` int64 ``[images, 3]``; when it has videos: ``pixel_values_videos``, ``video_grid_thw`` and
``second_per_grid_ts`` float32 ``[videos]`` (temporal patch / fps, for Qwen2.5-VL's M-RoPE).
The keys are left out when there is nothing to put in them, so ``model(pixel_values=batch.get(...))`` skips the
tower. ``position_ids`` are 1D text positions; a model with M-RoPE computes its own from ``tokens`` and the grids:
over a whole packed row they shift each later sample by one constant in all three components, which rotary
attention inside a block cannot see (tests/vlm/test_vlm_data_model.py checks the losses).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from loongforge.data.contracts import BalancedRows
from loongforge.data.errors import DataError
from loongforge.data.packing import pack_rows, sequence_boundaries

from loongforge_vlm.data.dataset import VisionChatDataset, VisionSample
from loongforge_vlm.data.tokens import VisionTokenIds, vision_mask

logger = logging.getLogger(__name__)


def row_cut(ids: np.ndarray, supervised: np.ndarray, seq_length: int, vision: VisionTokenIds) -> int | str:
    """How many of a sample's ids a row keeps (``seq_length + 1`` at most), or why it cannot hold the sample:
    a vision token would be cut, or every target would."""
    if len(ids) <= seq_length + 1:
        return len(ids)
    where = np.flatnonzero(vision_mask(ids, vision))
    if len(where) and where[-1] >= seq_length:
        return f"{len(ids) - 1} tokens, and a row of {seq_length} would cut its image or video tokens"
    if not supervised[1: seq_length + 1].any():
        return f"{len(ids) - 1} tokens, and a row of {seq_length} holds none of its reply"
    return seq_length + 1


def collate(rows: Sequence[Sequence[VisionSample]], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The batch of ``rows`` (each a list of samples that fit in ``seq_length`` input tokens); keys above."""
    b, s = len(rows), seq_length
    tokens = np.full((b, s), pad_id, dtype=np.int64)
    labels = np.full((b, s), pad_id, dtype=np.int64)
    loss_mask = np.zeros((b, s), dtype=np.float32)
    positions = np.tile(np.arange(s, dtype=np.int64), (b, 1))
    segments = np.full((b, s), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        start = 0
        for k, sample in enumerate(row):
            n = len(sample.ids) - 1
            if start + n > s:
                raise DataError(f"row {r} overflows: {sample.where} needs {n} tokens, {s - start} are left")
            tokens[r, start: start + n] = sample.ids[:-1]
            labels[r, start: start + n] = sample.ids[1:]
            loss_mask[r, start: start + n] = sample.supervised[1:]
            positions[r, start: start + n] = np.arange(n)
            segments[r, start: start + n] = k
            start += n
        positions[r, start:] = np.arange(s - start)
    samples = [sample for row in rows for sample in row]
    batch = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(positions),
        "segment_ids": torch.from_numpy(segments),
        "cu_seqlens": torch.tensor(sequence_boundaries(segments), dtype=torch.int32),
    }
    for pixels, grids in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if any(len(getattr(x, grids)) for x in samples):
            batch[pixels] = torch.from_numpy(np.concatenate([getattr(x, pixels) for x in samples]))
            batch[grids] = torch.from_numpy(np.concatenate([getattr(x, grids) for x in samples]))
    if "video_grid_thw" in batch:
        batch["second_per_grid_ts"] = torch.from_numpy(np.concatenate([x.second_per_grid_ts for x in samples]))
    return batch


class VisionRowDataset(BalancedRows):
    """Training rows over some samples of a :class:`VisionChatDataset`; ``batch(indices)`` is a micro-batch.

    ``rows`` lists the dataset indices in each row; with ``pack`` several samples share a row.
    """

    def __init__(self, dataset: VisionChatDataset, sample_indices: Sequence[int], seq_length: int, *,
                 pack: bool) -> None:
        self.dataset = dataset
        self.seq_length = seq_length
        self.pack = pack
        self.sample_indices = list(sample_indices)
        lengths = [min(len(dataset.entries[i].chat.ids), seq_length + 1) - 1 for i in self.sample_indices]
        placed = pack_rows(lengths, seq_length) if pack else [[k] for k in range(len(lengths))]
        self.rows = [[self.sample_indices[k] for k in row] for row in placed]

    def __len__(self) -> int:
        return len(self.rows)

    def row_samples(self, row: int) -> list[VisionSample]:
        """The samples of one row, each cut to the row length (:func:`split_rows` checked that they fit)."""
        cut = self.seq_length + 1
        return [replace(sample, ids=sample.ids[:cut], supervised=sample.supervised[:cut])
                for sample in map(self.dataset.__getitem__, self.rows[row])]

    def collate_rows(self, rows: Sequence[Sequence[VisionSample]]) -> dict[str, torch.Tensor]:
        """The micro-batch of ``rows`` of samples (see :func:`collate`)."""
        return collate(rows, self.seq_length, self.dataset.tokenizer.pad_id)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        return self.collate_rows([self.row_samples(int(row)) for row in indices])

    def balanced_batches(self, balance: Any, *, micro_batch_size: int, num_microbatches: int, seed: int,
                         dp_rank: int, dp_size: int) -> Any:
        """Batches that re-place this step's samples across data-parallel ranks through ``balance`` (the host's
        ``balance_samples``); see :mod:`loongforge_vlm.data.balanced`. Needs packed rows: unpacked rows are each
        padded to ``seq_length``, so every rank already does the same compute."""
        from loongforge_vlm.data.balanced import BalancedBatches

        if not self.pack:
            raise DataError("data-parallel balancing re-packs each rank's samples into its rows and needs data.pack: "
                            "true (unpacked rows are padded to seq_length: every rank does the same compute)")
        return BalancedBatches(self, micro_batch_size, seed, balance=balance, num_microbatches=num_microbatches,
                               dp_rank=dp_rank, dp_size=dp_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batch([index])


def split_rows(dataset: VisionChatDataset, seq_length: int, *, pack: bool,
               valid_fraction: float = 0.0) -> tuple[VisionRowDataset, VisionRowDataset | None]:
    """Training and validation rows: samples that cannot fit a row are skipped and counted (or raise when the
    dataset is strict), then the last ``valid_fraction`` of the rest is held out, before packing."""
    if seq_length < 1:
        raise DataError(f"seq_length must be >= 1, got {seq_length}")
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    keep = []
    before = dataset.skipped.total
    for i, entry in enumerate(dataset.entries):
        cut = row_cut(entry.chat.ids, entry.chat.supervised, seq_length, dataset.vision_tokens)
        if isinstance(cut, str):
            dataset.skipped.skip("too_long", entry.where, cut)
        else:
            keep.append(i)
    if dataset.skipped.total > before:
        logger.warning(dataset.skipped.summary(dataset.num_records))
    if not keep:
        raise DataError(f"no sample fits a row of {seq_length} tokens ({dataset.skipped.summary(dataset.num_records)})")
    num_valid = max(1, round(len(keep) * valid_fraction)) if valid_fraction else 0
    if num_valid >= len(keep):
        raise DataError(f"{len(keep)} sample(s) are too few to hold out {valid_fraction:.0%} for validation")
    train = VisionRowDataset(dataset, keep[: len(keep) - num_valid], seq_length, pack=pack)
    valid = VisionRowDataset(dataset, keep[len(keep) - num_valid:], seq_length, pack=pack) if num_valid else None
    return train, valid
