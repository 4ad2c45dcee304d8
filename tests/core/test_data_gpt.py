"""GPT samples and the resumable batch order: exact windows, exact resume, rank partitioning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge.data.errors import DataError
from loongforge.data.gpt_dataset import GPTSampleDataset, train_valid_split
from loongforge.data.indexed import MMapTokenDataset, TokenDatasetWriter
from loongforge.data.sampler import TrainBatchIterator, eval_batches
from torch.utils.data import DataLoader


@pytest.fixture
def tokens(tmp_path):
    """A stream 0, 1, 2, ... 1000 so that every token's value is its position."""
    with TokenDatasetWriter(tmp_path / "ds", vocab_size=1001, tokenizer_name="t", eos_id=1000) as w:
        w.add_document(np.arange(1000))
    return MMapTokenDataset(tmp_path / "ds")


def test_samples_are_shifted_windows_of_the_stream(tokens):
    ds = GPTSampleDataset(tokens, 8)
    assert len(ds) == (1001 - 1) // 8
    batch = ds.batch(np.array([0, 3, 124]))
    assert batch["tokens"].tolist()[1] == list(range(24, 32))
    assert batch["labels"].tolist()[1] == list(range(25, 33))
    assert batch["labels"][2, -1].item() == 1000  # the eos at the very end is reachable
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and batch["loss_mask"].sum().item() == 3 * 8
    assert batch["position_ids"].tolist() == [list(range(8))] * 3
    with pytest.raises(IndexError):
        ds.batch(np.array([125]))


def test_dataloader_collation_matches_batch(tokens):
    ds = GPTSampleDataset(tokens, 16)
    loaded = next(iter(DataLoader(ds, batch_size=4)))
    direct = ds.batch(np.arange(4))
    assert loaded.keys() == direct.keys()
    assert all(torch.equal(loaded[k], direct[k]) for k in direct)


def test_train_valid_split_holds_out_the_tail(tokens):
    train, valid = train_valid_split(tokens, 8, 0.1)
    assert (len(train), len(valid)) == (113, 12)
    assert valid.batch(np.array([0]))["tokens"][0, 0].item() == 113 * 8
    assert train.batch(np.array([112]))["labels"][0, -1].item() == 113 * 8  # only the seam token is shared
    assert train_valid_split(tokens, 8, 0.0)[1] is None
    with pytest.raises(DataError, match="too few"):
        train_valid_split(tokens, 600, 0.5)
    with pytest.raises(DataError, match="out of range"):
        GPTSampleDataset(tokens, 8, first_sample=120, num_samples=10)


def take(iterator, steps):
    return [next(iterator)["tokens"] for _ in range(steps)]


def test_order_is_a_fresh_permutation_every_epoch(tokens):
    ds = GPTSampleDataset(tokens, 100)  # 10 samples; sample i starts with token 100*i
    it = TrainBatchIterator(ds, micro_batch_size=5, seed=3)
    firsts = [b[:, 0].div(100, rounding_mode="floor").tolist() for b in take(it, 4)]
    epoch0, epoch1 = firsts[0] + firsts[1], firsts[2] + firsts[3]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert it.epoch == 2 and it.consumed_samples == 20
    again = TrainBatchIterator(ds, micro_batch_size=5, seed=3)
    assert [b[:, 0].div(100, rounding_mode="floor").tolist() for b in take(again, 4)] == firsts
    other_seed = TrainBatchIterator(ds, micro_batch_size=5, seed=4)
    assert [b[:, 0].div(100, rounding_mode="floor").tolist() for b in take(other_seed, 2)] != firsts[:2]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_resume_continues_exactly_across_epoch_boundaries(tokens, dp_size):
    ds = GPTSampleDataset(tokens, 30)  # 33 samples: global batches of 3 or 6 straddle epochs
    def run(rank):
        return TrainBatchIterator(ds, micro_batch_size=3, seed=11, dp_rank=rank, dp_size=dp_size)
    for rank in range(dp_size):
        reference = take(run(rank), 25)
        interrupted = run(rank)
        take(interrupted, 9)
        state = interrupted.state_dict()
        resumed = run(rank)
        resumed.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(take(resumed, 16), reference[9:], strict=True))
        from_start_sample = TrainBatchIterator(ds, 3, 11, rank, dp_size, start_sample=state["consumed_samples"])
        assert torch.equal(next(from_start_sample)["tokens"], reference[9])


def test_ranks_partition_the_global_batch(tokens):
    ds = GPTSampleDataset(tokens, 10)  # 100 samples
    single = TrainBatchIterator(ds, micro_batch_size=8, seed=0)
    ranks = [TrainBatchIterator(ds, micro_batch_size=2, seed=0, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(30):  # 2.4 epochs
        assert torch.equal(next(single)["tokens"], torch.cat([next(it)["tokens"] for it in ranks]))


def test_resume_refuses_another_seed_or_dataset(tokens):
    it = TrainBatchIterator(GPTSampleDataset(tokens, 10), micro_batch_size=2, seed=0)
    with pytest.raises(DataError, match="checkpoint has seed 1 over 100 samples, this run has seed 0"):
        it.load_state_dict({"consumed_samples": 4, "seed": 1, "num_samples": 100})
    with pytest.raises(DataError, match="over 50 samples"):
        it.load_state_dict({"consumed_samples": 4, "seed": 0, "num_samples": 50})
    with pytest.raises(DataError, match="no training samples"):
        TrainBatchIterator(GPTSampleDataset(tokens, 2000), micro_batch_size=1, seed=0)


def test_eval_batches_are_in_order_and_equal_per_rank(tokens):
    ds = GPTSampleDataset(tokens, 10, first_sample=90, num_samples=10)
    per_rank = [list(eval_batches(ds, 2, dp_rank=r, dp_size=2)) for r in range(2)]
    assert [len(b) for b in per_rank] == [2, 2]  # 10 samples, global batch 4: the last 2 are dropped
    firsts = [b["tokens"][:, 0].div(10, rounding_mode="floor").tolist() for b in per_rank[0]]
    assert firsts == [[90, 91], [94, 95]]
