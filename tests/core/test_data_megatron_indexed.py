"""Megatron-LM indexed datasets (``.bin`` / ``.idx``) as training data: written by megatron-core's own
``IndexedDatasetBuilder`` the way Megatron-LM's ``tools/preprocess_data.py`` writes them (sentences grouped into
documents, ``eod`` appended), read through ``data.dataset: megatron``, and trained on; and the other direction,
``loongforge preprocess`` output read by megatron-core's ``IndexedDataset``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from data_training import assert_learns, paragraphs, train_losses
from loongforge.data.errors import DataError
from loongforge.data.gpt_dataset import train_valid_split
from loongforge.data.indexed import DTYPE_CODES, INDEX_MAGIC, MMapTokenDataset, _read_index, dataset_files
from loongforge.data.kinds import mmap_dataset
from loongforge.data.tokenizers import ByteTokenizer
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

TOK = ByteTokenizer()


def megatron_preprocess(prefix, texts, *, vocab_size=TOK.vocab_size):
    """What ``preprocess_data.py --split-sentences --append-eod`` stores: per document its sentences as sequences,
    the last one ending with eod, then ``end_document``; the dtype megatron picks for the vocabulary."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    for text in texts:
        sentences = [s for s in text.replace(". ", ".\0").split("\0") if s]
        for i, sentence in enumerate(sentences):
            ids = TOK.encode(sentence + (" " if i < len(sentences) - 1 else ""))
            builder.add_item(torch.tensor(ids + ([TOK.eos_id] if i == len(sentences) - 1 else [])))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_documents_come_from_the_document_index(tmp_path):
    texts = ["First one. It has two sentences.", "Second. Three. Sentences.", "Third."]
    prefix = megatron_preprocess(tmp_path / "corpus_text_document", texts)
    assert len(IndexedDataset(str(prefix))) == 6  # sequences (sentences), not documents
    ds = mmap_dataset([str(prefix)], TOK)
    assert len(ds) == 3 and ds.tokenizer_name is None
    assert [TOK.decode(ds[i]) for i in range(3)] == texts
    assert all(int(ds[i][-1]) == TOK.eos_id for i in range(3))
    # training windows run over the whole stream, in file order, as megatron's GPTDataset reads it
    train, _ = train_valid_split(ds, 8, 0.0)
    stream = np.concatenate([ds[i] for i in range(3)])
    assert train.windows(np.array([0, 2]))[1].tolist() == stream[16:25].tolist()


def test_a_tokenizer_that_cannot_have_written_the_ids_is_refused(tmp_path):
    """Megatron's files name no tokenizer; ids past the run's vocabulary (a 50k-vocab corpus read with the byte
    tokenizer) are refused in one line naming the file."""
    builder = IndexedDatasetBuilder(f"{tmp_path / 'gpt2'}.bin", dtype=DType.optimal_dtype(50257))
    builder.add_item(torch.tensor([464, 3290, 50256]))
    builder.end_document()
    builder.finalize(f"{tmp_path / 'gpt2'}.idx")
    with pytest.raises(DataError) as info:
        mmap_dataset([str(tmp_path / "gpt2")], TOK)
    message = str(info.value)
    assert f"{tmp_path / 'gpt2.bin'}: token id 464 at token 0 is outside the vocabulary" in message
    assert "tokenizer 'byte': 259 ids" in message and "\n" not in message


def test_preprocess_cli_writes_what_megatron_core_reads(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("Alpha paragraph,\nstill alpha.\n\nBeta.\n\n\nGamma.\n", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "loongforge.cli", "preprocess", str(text), "--output",
                             str(tmp_path / "notes")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 documents" in result.stdout
    theirs = IndexedDataset(str(tmp_path / "notes"))
    assert theirs.document_indices.tolist() == [0, 1, 2, 3]
    assert [TOK.decode(theirs[i]) for i in range(3)] == ["Alpha paragraph,\nstill alpha.", "Beta.", "Gamma."]
    assert [int(theirs[i][-1]) for i in range(3)] == [TOK.eos_id] * 3


@pytest.mark.slow
def test_a_megatron_lm_dataset_trains(tmp_path):
    prefix = megatron_preprocess(tmp_path / "austen_text_document", paragraphs())
    losses = train_losses(tmp_path, {"dataset": "megatron", "paths": [str(prefix)], "tokenizer": "byte"})
    assert_learns(losses)


def test_the_format_constants_are_megatrons():
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    assert INDEX_MAGIC == _INDEX_HEADER
    assert {code: np.dtype(dtype) for code, dtype in DTYPE_CODES.items()} == {
        member.value: np.dtype(member.name) for member in DType}


@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_the_index_reads_as_megatron_reads_it(tmp_path, code, multimodal):
    """Every dtype megatron writes, sentences grouped into documents, and a multimodal index's trailing modes: our
    numpy reader (what ``check`` and training open) gives megatron's ``IndexedDataset`` arrays, and the tokens."""
    dtype = np.dtype(DTYPE_CODES[code])
    prefix = str(tmp_path / "mixed")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype.type, multimodal=multimodal)
    rng = np.random.default_rng(code)
    for document in range(4):
        for sentence in range(1 + document % 3):
            builder.add_item(torch.from_numpy(rng.integers(0, 100, size=2 + sentence * 3).astype(dtype)),
                             mode=sentence % 2)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    theirs = IndexedDataset(prefix, multimodal=multimodal)
    ours = _read_index(*dataset_files(prefix)[:2])
    assert ours.dtype == np.dtype(theirs.index.dtype)
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        assert getattr(ours, name).tolist() == getattr(theirs.index, name).tolist(), name
    if dtype.kind in "iu":
        stream = MMapTokenDataset(prefix).tokens
        sequences = [theirs[i][0] if multimodal else theirs[i] for i in range(len(theirs))]  # (tokens, mode)
        assert stream.tolist() == np.concatenate(sequences).tolist()
