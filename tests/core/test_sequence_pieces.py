"""Packed rows split per sequence over context-parallel ranks (no processes): each rank's tokens, positions and
loss mask against megatron's zig-zag rule recomputed here, the natural order that puts them back together, and
dynamic CP's whole-sequence deal."""

from __future__ import annotations

import torch
from loongforge.parallel.sequence_pieces import split_packed_for_rank

CP = 2
LENGTHS = [[5, 4, 3], [7, 3, 2]]  # two packed rows of 12 tokens; the last "sequence" of row 2 has no target


def _batch():
    positions = torch.cat([torch.arange(n) for row in LENGTHS for n in row]).reshape(2, 12)
    tokens = torch.arange(1, 25).reshape(2, 12)
    loss_mask = torch.ones(2, 12)
    loss_mask[1, 10:] = 0  # row 2's padding tail
    return {"tokens": tokens, "labels": tokens + 100, "loss_mask": loss_mask, "position_ids": positions,
            "attention_mask": torch.zeros(2, 1, 12, 12, dtype=torch.bool)}


def _expected(rank: int, key: str) -> torch.Tensor:
    """Megatron's rule per sequence: pad to a multiple of 2*cp, cut into 2*cp chunks, keep r and 2*cp-1-r."""
    flat, parts, start = _batch()[key].reshape(-1), [], 0
    for n in [5, 4, 3, 7, 3]:  # the target-free tail (2 tokens) is left out
        values = torch.arange(n) if key == "position_ids" else flat[start:start + n]
        start += n
        padded = -(-n // (2 * CP)) * 2 * CP
        whole = torch.arange(padded) if key == "position_ids" else torch.cat(
            [values, torch.zeros(padded - n, dtype=values.dtype)])
        chunks = whole.reshape(2 * CP, -1)
        parts += [chunks[rank], chunks[2 * CP - 1 - rank]]
    return torch.cat(parts)


def test_each_sequence_is_split_zig_zag_on_its_own_and_put_back_in_order():
    parts = [split_packed_for_rank(_batch(), rank, CP) for rank in range(CP)]
    for rank, part in enumerate(parts):
        assert set(part) == {"tokens", "labels", "loss_mask", "position_ids", "packed_seq_params"}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert part[key].shape == (1, 14) and torch.equal(part[key][0], _expected(rank, key)), (rank, key)
    assert sum(part["loss_mask"].sum() for part in parts) == _batch()["loss_mask"].sum()
    # the natural order of the ranks' rows concatenated: every sequence whole, padding after its tokens
    order, segments = parts[0]["packed_seq_params"].natural_order()
    gathered = torch.cat([part["tokens"][0] for part in parts])[order]
    expected = [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9], [10, 11, 12, 0], [13, 14, 15, 16, 17, 18, 19, 0],
                [20, 21, 22, 0]]
    assert gathered.tolist() == [t for sequence in expected for t in sequence]
    assert segments.tolist() == [i for i, sequence in enumerate(expected) for _ in sequence]


def test_dynamic_cp_deals_short_sequences_whole_and_balanced():
    parts = [split_packed_for_rank(_batch(), rank, CP, threshold=7) for rank in range(CP)]
    layout = parts[0]["packed_seq_params"]
    assert not layout.split and layout.local_length == 12
    # longest first to the rank with fewest tokens: 7 -> 0, 5 -> 1, 4 -> 1, 3 -> 0, 3 -> 1 (data order per rank)
    assert parts[0]["tokens"][0].tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 0, 0]
    assert parts[1]["tokens"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22]
    assert parts[0]["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert parts[1]["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert layout.segments(0).tolist() == [2] * 3 + [3] * 7 + [5] * 2  # rank 0's own padding sequence
    # one sequence longer than the threshold: the whole micro-batch is split
    assert split_packed_for_rank(_batch(), 0, CP, threshold=6)["packed_seq_params"].split
