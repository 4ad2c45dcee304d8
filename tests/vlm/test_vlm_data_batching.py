"""Rows and batches: a packed row holds each sample exactly as it is unpacked, images follow token order, rows
that would cut an image are refused, and core's seeded batch order resumes over them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from loongforge.data.errors import DataError
from loongforge.data.sampler import TrainBatchIterator
from loongforge.parallel.packed_rows import PackedRows
from loongforge_vlm.data.batching import VisionRowDataset, split_rows
from loongforge_vlm.data.dataset import VisionChatDataset
from loongforge_vlm.data.sources import JsonlSource
from vlm_data_helpers import PROCESSOR, TOKENIZER, ask, png, write_jsonl

IDS = TOKENIZER.vision_tokens
SEQ = 96


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> VisionChatDataset:
    """Eight samples with 0, 1 or 2 images of 1 or 4 tokens, different lengths."""
    folder = tmp_path_factory.mktemp("rows")
    sizes = {f"i{k}.png": png(28 * (1 + k % 2), 28 * (1 + k % 2), k) for k in range(6)}
    lines = [
        {"image": "i0.png", "messages": ask("Colour?", "red")},
        {"images": ["i1.png", "i2.png"], "messages": ask("Which has more shapes?", "the first one", images=2)},
        {"messages": [{"role": "user", "content": "No image: 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"image": "i3.png", "messages": ask("Count?", "3")},
        {"image": "i4.png", "messages": ask("Describe the picture in a few words.", "a small blue square")},
        {"images": ["i5.png", "i0.png"], "messages": ask("Same?", "no", images=2)},
        {"image": "i1.png", "messages": ask("Shape?", "circle")},
        {"image": "i2.png", "messages": ask("Big?", "yes")},
    ]
    return VisionChatDataset([JsonlSource(write_jsonl(folder / "d.jsonl", lines, sizes))], TOKENIZER, PROCESSOR)


def _image_runs(tokens: torch.Tensor) -> list[int]:
    """Lengths of the runs of image pad tokens in row-major order."""
    flat = tokens.flatten().tolist()
    runs, count = [], 0
    for token in flat + [-1]:
        if token == IDS.image_pad:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    return runs


def test_packed_rows_hold_each_sample_as_unpacked(dataset):
    packed, _ = split_rows(dataset, SEQ, pack=True)
    single, _ = split_rows(dataset, SEQ, pack=False)
    assert len(single) == 8 and len(packed) < len(single)
    assert sorted(i for row in packed.rows for i in row) == list(range(8))
    batch = packed.batch(np.arange(len(packed)))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "segment_ids", "cu_seqlens",
                          "pixel_values", "image_grid_thw"}  # no videos: no video keys; no s x s mask
    images_seen = 0
    for r, row in enumerate(packed.rows):
        for k, sample_index in enumerate(row):
            alone = single.batch([sample_index])
            n = int((alone["tokens"][0] != TOKENIZER.pad_id).sum())  # samples end in eos, never in pad
            in_row = batch["segment_ids"][r] == k
            assert int(in_row.sum()) == n == len(dataset[sample_index].ids) - 1
            for key in ("tokens", "labels", "loss_mask"):
                assert torch.equal(batch[key][r][in_row], alone[key][0][:n]), key
            assert torch.equal(batch["position_ids"][r][in_row], torch.arange(n))
            grids = alone.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
            assert torch.equal(batch["image_grid_thw"][images_seen: images_seen + len(grids)], grids)
            images_seen += len(grids)
    assert images_seen == len(batch["image_grid_thw"]) == 9
    # the images' pixels follow in token order, and every image's run of pad tokens has its token count
    expected = torch.cat([single.batch([i]).get("pixel_values", torch.zeros(0, 1176)) for row in packed.rows
                          for i in row])
    assert torch.equal(batch["pixel_values"], expected)
    assert _image_runs(batch["tokens"]) == [PROCESSOR.num_tokens(g) for g in batch["image_grid_thw"].tolist()]
    assert not batch["loss_mask"][np.isin(batch["tokens"].numpy(), list(vars(IDS).values()))].any()


def test_segments_cu_seqlens_and_mask_agree(dataset):
    packed, _ = split_rows(dataset, SEQ, pack=True)
    batch = packed.batch([0, 1])
    segments = batch["segment_ids"]
    boundaries = [0]
    for r in range(2):
        for k in range(int(segments[r].max()) + 1):
            boundaries.append(r * SEQ + int(((segments[r] >= 0) & (segments[r] <= k)).sum()))
        if boundaries[-1] != (r + 1) * SEQ:
            boundaries.append((r + 1) * SEQ)  # the padding tail is a segment of its own
    assert batch["cu_seqlens"].tolist() == boundaries and batch["cu_seqlens"].dtype == torch.int32
    mask = PackedRows.from_cu_seqlens(batch["cu_seqlens"], 2, SEQ).dense_mask()[:, 0]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    assert torch.equal(~mask, same & causal)
    unpacked = split_rows(dataset, SEQ, pack=False)[0]
    assert "pixel_values" not in unpacked.batch([2]) and "image_grid_thw" not in unpacked.batch([2])  # text only


def test_long_samples_are_cut_after_their_images_or_skipped(tmp_path):
    long_reply = "a long answer " * 6
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"image": "a.png", "messages": ask("Q?", long_reply)},  # image early: cut inside the reply
        {"image": "a.png", "messages": ask("Q?" * 40, "A")},  # image fine, but no reply inside the row
        {"messages": [{"role": "user", "content": "x" * 40 + "<image>"}, {"role": "assistant", "content": "A"}],
         "image": "b.png"},  # the image tokens would be cut
    ], {"a.png": png(28, 28, 0), "b.png": png(56, 56, 1)})
    dataset = VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR)
    train, _ = split_rows(dataset, 40, pack=True)
    assert train.rows == [[0]]
    assert dataset.skipped.counts == {"too_long": 2}
    assert f"first: {path} line 2: 109 tokens, and a row of 40 holds none of its reply" in \
        dataset.skipped.summary(dataset.num_records)
    batch = train.batch([0])
    assert batch["tokens"].shape == (1, 40) and batch["loss_mask"][0].sum() > 0
    assert torch.equal(batch["tokens"][0], torch.from_numpy(dataset[0].ids[:40]))
    strict = VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR, strict=True)
    with pytest.raises(DataError, match=f"^{path} line 2: 109 tokens"):
        split_rows(strict, 40, pack=True)


def test_split_holds_out_the_last_samples_and_works_as_a_core_dataset(dataset):
    train, valid = dataset.split_samples(SimpleNamespace(seq_length=SEQ, pack=True, valid_fraction=0.25))
    assert sorted(i for row in train.rows for i in row) == list(range(6))
    assert sorted(i for row in valid.rows for i in row) == [6, 7]
    assert isinstance(train, VisionRowDataset)
    # core's seeded, resumable order: a fresh iterator loaded from the state continues identically
    run = TrainBatchIterator(train, micro_batch_size=2, seed=3)
    first = [next(run) for _ in range(3)]
    resumed = TrainBatchIterator(train, micro_batch_size=2, seed=3)
    resumed.load_state_dict({**run.state_dict(), "consumed_samples": 2})
    for expected in first[1:]:
        got = next(resumed)
        assert all(torch.equal(got[key], expected[key]) for key in expected)
