"""The token dataset format (Megatron-LM's indexed dataset plus our tokenizer sidecar): round trips through
megatron-core's own reader and builder, dtype choice, and verification on open."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch
from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset, TokenDatasetWriter, dataset_files
from loongforge.data.tokenizers import ByteTokenizer
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def write(prefix, docs, *, vocab_size=259, eos_id=257, tokenizer_name="byte"):
    with TokenDatasetWriter(prefix, vocab_size=vocab_size, tokenizer_name=tokenizer_name, eos_id=eos_id) as w:
        for doc in docs:
            w.add_document(doc)
    return MMapTokenDataset(prefix)


def megatron_write(prefix, documents, dtype=np.uint16):
    """A dataset as Megatron-LM writes it: each document a list of sentences (``add_item`` + ``end_document``)."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for sentences in documents:
        for sentence in sentences:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return prefix


def test_round_trip_documents_with_eos(tmp_path):
    docs = [[1, 2, 3], np.array([7], dtype=np.int64), [], [255, 0]]
    ds = write(tmp_path / "sub" / "ds", docs)
    assert len(ds) == 4 and ds.num_tokens == 3 + 1 + 0 + 2 + 4
    for got, want in zip([ds[i] for i in range(4)], docs, strict=True):
        assert got.tolist() == [*list(want), 257]
    assert ds[-1].tolist() == [255, 0, 257]
    assert ds.tokens.dtype == np.uint16 and ds.doc_offsets.tolist() == [0, 4, 6, 7, 10]
    assert json.loads(dataset_files(ds.prefix)[2].read_text())["tokenizer"] == "byte"
    assert (ds.tokenizer_name, ds.vocab_size, ds.eos_id) == ("byte", 259, 257)
    with pytest.raises(IndexError):
        ds[4]


def test_what_we_write_is_read_by_megatron_core_unchanged(tmp_path):
    ds = write(tmp_path / "ds", [[1, 2, 3], [9]])
    theirs = IndexedDataset(str(ds.prefix))
    assert [theirs[i].tolist() for i in range(len(theirs))] == [[1, 2, 3, 257], [9, 257]]
    assert theirs.document_indices.tolist() == [0, 1, 2] and theirs.index.dtype == np.uint16


def test_megatron_written_documents_follow_the_document_index(tmp_path):
    """Megatron-LM's preprocessing may store a document as several sentences: ``ds[i]`` is the whole document."""
    prefix = megatron_write(tmp_path / "theirs", [[[5, 6], [7]], [[8, 9, 10]], [[11], [12], [13, 1]]])
    ds = MMapTokenDataset(prefix)
    assert len(ds) == 3 and ds.num_tokens == 10 and ds.tokenizer_name is None
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7], [8, 9, 10], [11, 12, 13, 1]]
    assert ds.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 1]


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


def test_missing_files_and_a_damaged_index_are_detected(tmp_path):
    with pytest.raises(DataError, match="token dataset not found: .*nope.idx"):
        MMapTokenDataset(tmp_path / "nope")
    ds = write(tmp_path / "ds", [[1, 2], [3]])
    bin_path, idx_path, sidecar_path = dataset_files(ds.prefix)
    good = idx_path.read_bytes()
    idx_path.write_bytes(b"NOTMEGA" + good[7:])
    with pytest.raises(DataError, match=r"ds\.idx: not a readable Megatron-LM index: bad header"):
        MMapTokenDataset(ds.prefix)
    idx_path.write_bytes(good[:40])
    with pytest.raises(DataError, match=r"ds\.idx: not a readable Megatron-LM index"):
        MMapTokenDataset(ds.prefix)
    # the document index (last int64s, no modes) claims 3 sequences where there are 2
    idx_path.write_bytes(good[:-8] + struct.pack("<q", 3))
    with pytest.raises(DataError, match=r"ds\.idx: the document index does not run in order from sequence 0 to 2"):
        MMapTokenDataset(ds.prefix)
    idx_path.write_bytes(good)
    sidecar_path.write_text("{not json")
    with pytest.raises(DataError, match=r"ds\.loongforge\.json: unreadable dataset sidecar"):
        MMapTokenDataset(ds.prefix)
    sidecar_path.unlink()
    bin_path.unlink()
    with pytest.raises(DataError, match=r"ds\.bin: missing"):
        MMapTokenDataset(ds.prefix)


def test_non_contiguous_sequences_are_refused(tmp_path):
    """Megatron's format allows sequences anywhere in the .bin; ours reads it as one stream, so gaps are refused."""
    ds = write(tmp_path / "ds", [[1, 2], [3]])
    idx_path = dataset_files(ds.prefix)[1]
    raw = bytearray(idx_path.read_bytes())
    pointers_at = 34 + 2 * 4  # header, then two int32 lengths, then the int64 offsets
    raw[pointers_at + 8 : pointers_at + 16] = struct.pack("<q", 4)
    idx_path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="not one contiguous token stream"):
        MMapTokenDataset(ds.prefix)


def test_rewriting_a_prefix_replaces_the_dataset(tmp_path):
    write(tmp_path / "ds", [[1, 2, 3]])
    ds = write(tmp_path / "ds", [[4]])
    assert ds.tokens.tolist() == [4, 257]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "ds.loongforge.json"]


def test_pickle_reopens_instead_of_copying(tmp_path):
    ds = write(tmp_path / "ds", [list(range(200))])
    blob = pickle.dumps(ds)
    assert len(blob) < 300
    again = pickle.loads(blob)
    assert np.array_equal(again.tokens, ds.tokens)


def test_check_tokenizer_by_sidecar_name(tmp_path):
    ds = write(tmp_path / "ds", [[1]], tokenizer_name="hf:other@123")
    with pytest.raises(DataError, match="built with tokenizer 'hf:other@123', but this run uses 'byte'"):
        ds.check_tokenizer(ByteTokenizer())


def test_check_tokenizer_of_a_foreign_dataset_by_its_ids(tmp_path):
    """Megatron-LM's files name no tokenizer: an id the tokenizer cannot produce is the one thing to refuse."""
    fits = MMapTokenDataset(megatron_write(tmp_path / "fits", [[[1, 258]], [[0]]]))
    fits.check_tokenizer(ByteTokenizer())
    wide = MMapTokenDataset(megatron_write(tmp_path / "wide", [[[1, 2]], [[3, 259, 4]]]))
    with pytest.raises(DataError) as info:
        wide.check_tokenizer(ByteTokenizer())
    message = str(info.value)
    assert str(tmp_path / "wide.bin") in message and "token id 259 at token 3" in message
    assert "tokenizer 'byte': 259 ids" in message and "\n" not in message


def test_float_tokens_are_refused(tmp_path):
    prefix = megatron_write(tmp_path / "floats", [[[1.0, 2.0]]], dtype=np.float32)
    with pytest.raises(DataError, match="stored as float32, not an integer type"):
        MMapTokenDataset(prefix)
