"""Move samples between data-parallel ranks according to a plan, with ``torch.distributed`` collectives.

There is no coordinator: one all-gather tells every rank every sample's sizes, every rank computes the same plan
from them (:mod:`.solver` is deterministic), and one ``all_to_all_single`` per field moves the payloads. A sample
is a ``dict`` of tensors whose first dimension varies per sample (``tokens`` [n], ``labels`` [n], ``pixel_values``
[patches, d], an ``id`` [1] ...); every rank's samples must have the same keys, dtypes and trailing shapes. A
sample's encoder work (:data:`~loongforge_balance.dp_balance.cost.ENCODER_KEY`, ``[2]``) is gathered by value, since
the cost model reads it.

Samples are numbered globally in rank order (rank 0's local samples, then rank 1's, ...); after the exchange a
rank holds the samples planned for it, in that global order, so the result does not depend on message timing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from loongforge_balance.dp_balance.cost import ENCODER_KEY


@dataclass(frozen=True)
class Layout:
    """Where every sample of the global batch is and how big it is, identical on every rank after the gather."""

    keys: tuple[str, ...]
    counts: np.ndarray  # int64 [ranks]: samples each rank holds now
    rows: np.ndarray  # int64 [samples, keys]: first-dimension size of each field of each sample
    lengths: np.ndarray  # int64 [samples]: tokens of each sample (the cost model's ``len``)
    rank: int  # this rank's index in the group
    encoder: np.ndarray | None = None  # int64 [samples, 2]: each sample's encoder work, when the samples give it

    @property
    def num_ranks(self) -> int:
        return len(self.counts)

    @property
    def owners(self) -> np.ndarray:
        """The rank holding each sample now (the sampler's assignment)."""
        return np.repeat(np.arange(self.num_ranks), self.counts)

    def rank_lengths(self) -> list[np.ndarray]:
        """Each rank's sample lengths, in rank order."""
        return np.split(self.lengths, np.cumsum(self.counts)[:-1])

    def rank_encoder(self) -> list[np.ndarray | None]:
        """Each rank's samples' encoder work ``[samples, 2]``, in rank order (``None`` each without it)."""
        if self.encoder is None:
            return [None] * self.num_ranks
        return np.split(self.encoder, np.cumsum(self.counts)[:-1])


def _keys(samples: Sequence[Mapping[str, torch.Tensor]]) -> tuple[str, ...]:
    if not samples:
        raise ValueError("this rank has no samples to balance: every data-parallel rank must bring at least one")
    keys = tuple(sorted(samples[0]))
    for index, sample in enumerate(samples):
        if tuple(sorted(sample)) != keys:
            raise ValueError(f"sample {index} has fields {sorted(sample)}, sample 0 has {list(keys)}")
        for key in keys:
            if sample[key].dim() == 0:
                raise ValueError(f"sample {index} field '{key}' is a scalar; give it a first dimension (shape [1])")
        if ENCODER_KEY in sample and tuple(sample[ENCODER_KEY].shape) != (2,):
            raise ValueError(f"sample {index} field '{ENCODER_KEY}' has shape {tuple(sample[ENCODER_KEY].shape)}; "
                             "it is [2]: (patches, sum of attention block lengths squared)")
    return keys


def gather_layout(
    samples: Sequence[Mapping[str, torch.Tensor]], group: dist.ProcessGroup | None = None, length_key: str = "tokens"
) -> Layout:
    """All-gather every sample's field sizes (and encoder work); ``length_key``'s first dimension is the sample's
    token count."""
    keys = _keys(samples)
    if length_key not in keys:
        raise ValueError(f"samples have no '{length_key}' field to measure their length by (fields: {list(keys)})")
    device = samples[0][keys[0]].device
    size = dist.get_world_size(group)
    count = torch.tensor([len(samples)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts_np = np.array([int(c.item()) for c in counts], dtype=np.int64)
    has_encoder = ENCODER_KEY in keys
    local = torch.zeros(int(counts_np.max()), len(keys) + 2 * has_encoder, dtype=torch.int64, device=device)
    local[: len(samples), : len(keys)] = torch.tensor([[s[k].shape[0] for k in keys] for s in samples],
                                                      dtype=torch.int64)
    if has_encoder:  # by value, in two extra columns of the same gather
        local[: len(samples), len(keys):] = torch.stack([s[ENCODER_KEY].to(torch.int64) for s in samples])
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    table = np.concatenate([g[:n].cpu().numpy() for g, n in zip(gathered, counts_np, strict=True)])
    rows = table[:, : len(keys)]
    encoder = table[:, len(keys):].copy() if has_encoder else None
    return Layout(keys, counts_np, rows, rows[:, keys.index(length_key)].copy(), dist.get_rank(group), encoder)


def exchange(
    samples: Sequence[Mapping[str, torch.Tensor]],
    layout: Layout,
    destinations: np.ndarray,
    group: dist.ProcessGroup | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Send each local sample to ``destinations[global index]``; return the samples this rank now holds."""
    starts = np.concatenate([[0], np.cumsum(layout.counts)])
    me = layout.rank
    mine = slice(int(starts[me]), int(starts[me + 1]))
    send_order = np.argsort(destinations[mine], kind="stable")
    incoming = np.flatnonzero(destinations == me)  # ascending global index = (source rank, local index) order
    ranks = np.arange(layout.num_ranks)
    received: dict[str, list[torch.Tensor]] = {}
    for f, key in enumerate(layout.keys):
        send_rows = np.bincount(destinations[mine], weights=layout.rows[mine, f], minlength=layout.num_ranks)
        recv_rows = np.bincount(layout.owners[incoming], weights=layout.rows[incoming, f], minlength=layout.num_ranks)
        template = samples[0][key]
        payload = torch.cat([samples[i][key] for i in send_order.tolist()]) if len(send_order) else template[:0]
        wire = payload.view(torch.uint8) if payload.dtype == torch.bool else payload  # gloo has no bool
        out = torch.empty((int(recv_rows.sum()), *template.shape[1:]), dtype=wire.dtype, device=template.device)
        dist.all_to_all_single(
            out, wire.contiguous(), recv_rows[ranks].astype(int).tolist(), send_rows[ranks].astype(int).tolist(),
            group=group,
        )
        out = out.view(torch.bool) if template.dtype == torch.bool else out
        received[key] = list(torch.split(out, layout.rows[incoming, f].tolist()))
    return [{key: received[key][i] for key in layout.keys} for i in range(len(incoming))]
