"""The memory-mapped token dataset format: round trips, dtype choice, and verification on open."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset, TokenDatasetWriter, dataset_files
from loongforge.data.tokenizers import ByteTokenizer


def write(prefix, docs, *, vocab_size=259, eos_id=257, tokenizer_name="byte"):
    with TokenDatasetWriter(prefix, vocab_size=vocab_size, tokenizer_name=tokenizer_name, eos_id=eos_id) as w:
        for doc in docs:
            w.add_document(doc)
    return MMapTokenDataset(prefix)


def test_round_trip_documents_with_eos(tmp_path):
    docs = [[1, 2, 3], np.array([7], dtype=np.int64), [], [255, 0]]
    ds = write(tmp_path / "sub" / "ds", docs)
    assert len(ds) == 4 and ds.num_tokens == 3 + 1 + 0 + 2 + 4
    for got, want in zip([ds[i] for i in range(4)], docs, strict=True):
        assert got.tolist() == [*list(want), 257]
    assert ds[-1].tolist() == [255, 0, 257]
    assert ds.tokens.dtype == np.uint16 and ds.doc_offsets.tolist() == [0, 4, 6, 7, 10]
    assert json.loads(dataset_files(ds.prefix)[2].read_text())["tokenizer"] == "byte"
    with pytest.raises(IndexError):
        ds[4]


def test_large_vocab_uses_int32(tmp_path):
    ds = write(tmp_path / "big", [[70000, 1], [65536]], vocab_size=80000, eos_id=79999)
    assert ds.tokens.dtype == np.int32
    assert ds[0].tolist() == [70000, 1, 79999] and ds[1].tolist() == [65536, 79999]
    assert dataset_files(ds.prefix)[0].stat().st_size == 5 * 4


def test_out_of_range_id_is_refused_and_nothing_is_left_behind(tmp_path):
    with pytest.raises(DataError, match="token id out of range 0..258 in document 1"):
        write(tmp_path / "ds", [[1], [300]])
    assert list(tmp_path.iterdir()) == []


def test_empty_writer_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no documents were added"):
        write(tmp_path / "ds", [])
    assert list(tmp_path.iterdir()) == []


def test_truncated_bin_is_detected_with_the_file_named(tmp_path):
    ds = write(tmp_path / "ds", [list(range(100))])
    bin_path = dataset_files(ds.prefix)[0]
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError) as info:
        MMapTokenDataset(tmp_path / "ds")
    message = str(info.value)
    assert str(bin_path) in message and "200 bytes" in message and "202 bytes" in message and "\n" not in message


def test_missing_files_and_bad_boundaries_are_detected(tmp_path):
    with pytest.raises(DataError, match="token dataset not found: .*nope.idx.json"):
        MMapTokenDataset(tmp_path / "nope")
    ds = write(tmp_path / "ds", [[1, 2], [3]])
    _, docs_path, idx_path = dataset_files(ds.prefix)
    np.save(docs_path, np.array([0, 3, 4, 5], dtype=np.int64))
    with pytest.raises(DataError, match="ds.docs.npy: document boundaries do not match"):
        MMapTokenDataset(ds.prefix)
    idx_path.write_text("{not json")
    with pytest.raises(DataError, match="ds.idx.json: unreadable dataset header"):
        MMapTokenDataset(ds.prefix)


def test_rewriting_a_prefix_replaces_the_dataset(tmp_path):
    write(tmp_path / "ds", [[1, 2, 3]])
    ds = write(tmp_path / "ds", [[4]])
    assert ds.tokens.tolist() == [4, 257]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.docs.npy", "ds.idx.json"]


def test_pickle_reopens_instead_of_copying(tmp_path):
    ds = write(tmp_path / "ds", [list(range(200))])
    blob = pickle.dumps(ds)
    assert len(blob) < 300
    again = pickle.loads(blob)
    assert np.array_equal(again.tokens, ds.tokens)


def test_check_tokenizer(tmp_path):
    ds = write(tmp_path / "ds", [[1]], tokenizer_name="hf:other@123")
    with pytest.raises(DataError, match="built with tokenizer 'hf:other@123', but this run uses 'byte'"):
        ds.check_tokenizer(ByteTokenizer())
