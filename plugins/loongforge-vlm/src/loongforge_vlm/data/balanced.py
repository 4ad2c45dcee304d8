"""Per-step data-parallel load balancing of image-text samples: unpack, balance across ranks, repack.

Why per step and unpacked: the sampler gives each data-parallel rank the same number of rows, but a row holds one
long sample or several short ones, and an image adds its vision tokens, so ranks do different amounts of compute.
Every step, each rank takes the samples of the rows the sampler gave it (exactly what the plain path trains),
passes them to ``loongforge_balance_samples`` (an optimization such as ``dp-balance`` moves samples between
ranks), and packs what it gets back into its rows. The rows per micro-batch and the micro-batches per step stay
fixed (megatron's schedule needs both), so a rank's capacity is ``micro-batches x micro_batch_size x seq_length``
tokens: that is the token cap a balancer must respect (``dp_token_cap``).

The token cap bounds tokens, but rows fragment, so the iterator also says which lengths its rows can hold
(``dp_fits``: longest first, best fit, the packing it does). The balancer checks every rank's planned samples with it
before moving any (a pure function of the gathered lengths: every rank agrees without a collective) and keeps the
sampler's placement for a step it cannot place (``dp-balance`` counts them as ``dp_balance/unfit_steps``): the step
trains the same samples with the same math (the loss normalised by the global token count,
``training.loss_normalization: global_tokens``). Carrying samples over to the next step would make the step's
sample set depend on the balancer; failing would end a run over a packing accident. A balancer that ignores
``dp_fits`` and hands a rank more than its rows hold stops the run with one line. A rank that gets back exactly its
own samples trains the sampler's rows, so with nothing moved the batches are bit-identical to the plain path's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from loongforge.data.errors import DataError
from loongforge.data.packing import pack_rows
from loongforge.data.sampler import TrainBatchIterator

from loongforge_vlm.data.dataset import VisionSample
from loongforge_vlm.data.processor import ImageProcessor

#: VisionSample fields sent as they are (their first dimension varies per sample).
_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
#: The field with the vision encoder's work, ``[patches, patch pairs]``, that a balancer's cost model reads (the
#: ``loongforge_balance_samples`` contract; loongforge-balance's ``dp_balance.cost.ENCODER_KEY``).
ENCODER_WORK = "encoder_work"


def encoder_work(sample: VisionSample, processor: ImageProcessor | None = None) -> tuple[int, int]:
    """``(patches, patch pairs)`` the vision tower computes for ``sample``: every patch of its images and videos,
    and attention within each image, tile or video frame group of ``h * w`` patches (a ``(t, h, w)`` grid is ``t``
    such blocks: Qwen's ViTs attend per frame group, InternViT and AnyRes SigLIP per tile), so ``t * (h * w) ** 2``
    pairs. ``processor`` (the one that made the sample) reads its grid rows as patch grids: an AnyRes row is
    ``(tiles, height, width)`` in pixels; without one the rows are taken as patch grids."""
    rows = np.concatenate([sample.image_grid_thw.reshape(-1, 3), sample.video_grid_thw.reshape(-1, 3)])
    grids = rows if processor is None else np.array([processor.encoder_grid(row) for row in rows.tolist()],
                                                    dtype=np.int64).reshape(-1, 3)
    t, area = grids[:, 0].astype(np.int64), grids[:, 1].astype(np.int64) * grids[:, 2]
    return int(np.sum(t * area)), int(np.sum(t * area * area))


def to_wire(index: int, sample: VisionSample, processor: ImageProcessor | None = None) -> dict[str, torch.Tensor]:
    """A sample as the balance hook takes it: ``tokens`` [n] are its input ids (text and vision tokens, as many as
    the processor counts for each image: the length the cost model sees), ``targets``/``supervised`` [n] the shifted
    ids and reply mask, ``index`` [1] its dataset index, :data:`ENCODER_WORK` [2] what its images and videos cost
    the vision tower (:func:`encoder_work` with ``processor``: a video of few LLM tokens can be many patches), and
    its pixels and grids."""
    wire = {
        "index": torch.tensor([index], dtype=torch.int64),
        "tokens": torch.from_numpy(np.ascontiguousarray(sample.ids[:-1])),
        "targets": torch.from_numpy(np.ascontiguousarray(sample.ids[1:])),
        "supervised": torch.from_numpy(np.ascontiguousarray(sample.supervised[1:])),
        ENCODER_WORK: torch.tensor(encoder_work(sample, processor), dtype=torch.int64),
    }
    return {**wire, **{key: torch.from_numpy(np.ascontiguousarray(getattr(sample, key))) for key in _MEDIA}}


def from_wire(wire: dict[str, torch.Tensor], where: str) -> VisionSample:
    """The :class:`VisionSample` back (``supervised[0]`` is never a target, so it is not sent)."""
    ids = torch.cat([wire["tokens"], wire["targets"][-1:]]).numpy()
    supervised = np.concatenate([[False], wire["supervised"].numpy()])
    return VisionSample(ids=ids, supervised=supervised, where=where, **{key: wire[key].numpy() for key in _MEDIA})


def _placement(lengths: Sequence[int], seq_length: int) -> tuple[list[int], list[list[int]]]:
    """Longest first (ties in the given order), best fit: the order and the rows of positions in that order. The
    number of rows depends only on the lengths, not on their order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return order, pack_rows([lengths[i] for i in order], seq_length)


def pack_into(samples: Sequence[VisionSample], num_rows: int, seq_length: int) -> list[list[VisionSample]] | None:
    """``samples`` packed into exactly ``num_rows`` rows (empty rows pad the end), or None when they need more."""
    order, placed = _placement([len(sample.ids) - 1 for sample in samples], seq_length)
    if len(placed) > num_rows:
        return None
    return [[samples[order[k]] for k in row] for row in placed] + [[] for _ in range(num_rows - len(placed))]


class BalancedBatches(TrainBatchIterator):
    """Micro-batches of the sampler's order (same state, same resume), balanced across ranks once per step.

    ``dataset`` is a :class:`~loongforge_vlm.data.batching.VisionRowDataset`; ``balance(samples)`` is the host's
    ``balance_samples`` bound to the data-parallel group. After each step, ``step_indices`` holds the dataset
    indices this rank trained.
    """

    #: Marks a data path that calls ``loongforge_balance_samples`` (an optimization checks it at train start).
    dp_balanced = True

    def __init__(self, dataset: Any, micro_batch_size: int, seed: int, *, balance: Callable[[list], list],
                 num_microbatches: int, dp_rank: int = 0, dp_size: int = 1, start_sample: int = 0) -> None:
        super().__init__(dataset, micro_batch_size, seed, dp_rank=dp_rank, dp_size=dp_size, start_sample=start_sample)
        self.balance = balance
        self.num_microbatches = num_microbatches
        self.num_rows = num_microbatches * micro_batch_size
        #: The most tokens this rank's rows hold in one step: the balancer's token cap.
        self.dp_token_cap = self.num_rows * dataset.seq_length
        self.step_indices: list[int] = []
        self._pending: deque[dict[str, torch.Tensor]] = deque()

    def dp_fits(self, lengths: Sequence[int]) -> bool:
        """Whether this step's rows of any rank hold samples of ``lengths`` tokens, packed as :meth:`_step` packs."""
        return len(_placement([int(n) for n in lengths], self.dataset.seq_length)[1]) <= self.num_rows

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self._pending:
            self._pending.extend(self._step())
        return self._pending.popleft()

    def state_dict(self) -> dict[str, Any]:
        if self._pending:  # checkpoints are taken between steps, when the step's batches are all used
            raise RuntimeError("cannot save the data position in the middle of a step")
        return super().state_dict()

    def _step(self) -> list[dict[str, torch.Tensor]]:
        """This step's micro-batches: the sampler's rows for this rank, unpacked, balanced and packed again."""
        mbs, global_rows = self.micro_batch_size, self.micro_batch_size * self.dp_size
        first = self.consumed_samples + self.dp_rank * mbs
        positions = np.concatenate([np.arange(first + k * global_rows, first + k * global_rows + mbs)
                                    for k in range(self.num_microbatches)])
        self.consumed_samples += self.num_microbatches * global_rows
        row_indices = [int(row) for row in self.sample_indices(positions)]
        rows = [self.dataset.row_samples(row) for row in row_indices]
        indices = [int(i) for row in row_indices for i in self.dataset.rows[row]]
        processor = self.dataset.dataset.processor
        own = [to_wire(i, sample, processor)
               for i, sample in zip(indices, (s for row in rows for s in row), strict=True)]
        received = self.balance(own)
        got = [int(wire["index"][0]) for wire in received]
        self.step_indices = got
        if got != indices:
            entries = self.dataset.dataset.entries
            samples = [from_wire(w, entries[i].where) for w, i in zip(received, got, strict=True)]
            rows = pack_into(samples, self.num_rows, self.dataset.seq_length)
            if rows is None:
                raise DataError(f"data-parallel rank {self.dp_rank} was given {len(got)} samples of "
                                f"{sum(len(w['tokens']) for w in received)} tokens that its {self.num_rows} rows of "
                                f"{self.dataset.seq_length} tokens cannot hold (the balancer must respect dp_fits)")
        return [self.dataset.collate_rows(rows[k * mbs:(k + 1) * mbs]) for k in range(self.num_microbatches)]
