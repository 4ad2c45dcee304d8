"""Token datasets on disk in Megatron-LM's indexed format, read without loading them.

Why Megatron-LM's format rather than one of our own: data already tokenized for Megatron-LM (its
``tools/preprocess_data.py``, NeMo, other megatron-core trainers) trains here unchanged, and what ``loongforge
preprocess`` writes trains there. Writing goes through megatron-core's own ``IndexedDatasetBuilder``, so the bytes
are exactly megatron's; reading is a numpy memory map of the same layout (what megatron's ``IndexedDataset`` does
inside), so that opening a dataset -- ``loongforge check`` does, before anything is built -- does not import
megatron-core; a test asserts both readers agree. A dataset at ``PREFIX`` is:

- ``PREFIX.bin``: the token ids of every document back to back (``uint16`` for vocabularies under 65,500, else
  ``int32``, as megatron picks); ours end each document with ``eos``.
- ``PREFIX.idx``: megatron's index -- per sequence its length and byte offset, and the *document index* (which
  sequences make up each document; megatron's preprocessing may split a document into sentences).
- ``PREFIX.loongforge.json`` (ours only): the tokenizer's name, vocabulary size and ``eos`` id. Megatron's files
  carry no tokenizer, so this sidecar is what lets a run refuse a dataset built with another tokenizer.

Documents come from the document index: ``ds[i]`` is document ``i`` whatever its sentences. Training windows
(:mod:`loongforge.data.gpt_dataset`) run over the concatenated stream as megatron's ``GPTDataset`` does, so the
separator between documents is whatever the file holds (Megatron-LM writes ``eos`` with ``--append-eod``).

Why verify on open: megatron's reader checks little (``assert`` on the magic bytes), and a truncated copy or a
``.bin`` paired with another ``.idx`` would train on garbage. The reader checks the index against itself and the
``.bin`` size, and fails with one line naming the file. Token ids are checked against a vocabulary by
:meth:`MMapTokenDataset.check_token_ids` -- all of a small file, an evenly spread sample of a large one, so that
opening stays cheap at any size; a foreign dataset (no sidecar) has only this check. The writer writes temporary
files and renames them into place with the index last, so an interrupted build never leaves a dataset that opens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loongforge.data.errors import DataError

#: Sidecar format name and version (also part of the cache key of tokenized text, see :mod:`loongforge.data.cache`).
FORMAT = "loongforge-tokens"
FORMAT_VERSION = 2
#: :meth:`MMapTokenDataset.check_token_ids` reads token files up to this size whole; of a larger one it reads
#: :data:`_SAMPLE_BLOCKS` evenly spaced blocks of this size in total (the first and the last block included).
_CHECKED_BYTES = 8 << 20
_SAMPLE_BLOCKS = 64
#: megatron's ``.idx`` header: magic bytes, version, dtype code, sequence count, document-mark count; then int32
#: lengths, int64 offsets and int64 document marks (and int8 modes for multimodal data).
_INDEX_SIZE = struct.Struct("<9sQBQQ")
#: The magic bytes an ``.idx`` starts with, and its dtype codes (megatron-core's ``_INDEX_HEADER`` and ``DType``;
#: tests/core/test_indexed_dataset.py asserts both equal megatron's, so a format change there fails a test here).
INDEX_MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}


def dataset_files(prefix: str | Path) -> tuple[Path, Path, Path]:
    """``(bin, idx, sidecar)`` paths of the dataset at ``prefix``."""
    prefix = str(Path(prefix).expanduser())
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + ".loongforge.json")


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype megatron-core stores ids ``0 .. vocab_size-1`` in (what its ``preprocess_data.py`` picks)."""
    from megatron.core.datasets.indexed_dataset import DType

    return np.dtype(DType.optimal_dtype(vocab_size))


class TokenDatasetWriter:
    """Appends documents (one megatron sequence each, ``eos`` added) to a new dataset; use as a context manager or
    call :meth:`finish`. Leaving the ``with`` block with an exception deletes the partial files."""

    def __init__(self, prefix: str | Path, *, vocab_size: int, tokenizer_name: str, eos_id: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = Path(prefix).expanduser()
        self.vocab_size = vocab_size
        self.sidecar = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": tokenizer_name,
                        "vocab_size": vocab_size, "eos_id": eos_id}
        self.dtype = token_dtype(vocab_size)
        self.eos_id = eos_id
        self.num_documents = 0
        self.num_tokens = 0
        self._final = dataset_files(self.prefix)
        self._tmp = tuple(p.with_name(f"{p.name}.tmp{os.getpid()}") for p in self._final)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._builder = IndexedDatasetBuilder(str(self._tmp[0]), dtype=self.dtype.type)

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ``eos`` is added here)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise DataError(f"{self.prefix}: token id out of range 0..{self.vocab_size - 1} in document "
                            f"{self.num_documents}")
        document = np.append(arr, self.eos_id)
        self._builder.add_document(document, [document.size])
        self.num_documents += 1
        self.num_tokens += document.size

    def finish(self) -> None:
        """Write the index and the sidecar, then move the files into place, the index last."""
        if not self.num_documents:
            self.abort()
            raise DataError(f"{self.prefix}: no documents were added")
        self._builder.finalize(str(self._tmp[1]))
        self._tmp[2].write_text(json.dumps(self.sidecar, indent=2) + "\n", encoding="utf-8")
        for tmp in self._tmp:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        for index in (0, 2, 1):
            os.replace(self._tmp[index], self._final[index])

    def abort(self) -> None:
        """Close and delete the partial files."""
        self._builder.data_file.close()
        for tmp in self._tmp:
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


class MMapTokenDataset:
    """A verified, read-only, memory-mapped indexed dataset; ``ds[i]`` is document ``i``.

    ``tokens`` is the whole stream as an array over a memory map of the ``.bin``: the OS pages in only what is read, so
    opening a dataset of any size is instant. ``tokenizer_name`` / ``vocab_size`` / ``eos_id`` come from our sidecar
    and are ``None`` for a dataset another tool wrote. Pickling stores only the prefix (DataLoader workers reopen
    the files instead of copying the tokens).
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix).expanduser()
        bin_path, idx_path, sidecar_path = dataset_files(self.prefix)
        if not idx_path.is_file():
            raise DataError(f"token dataset not found: {idx_path} (build it with `loongforge preprocess`)")
        index = _read_index(bin_path, idx_path)
        self.dtype = index.dtype
        if self.dtype.kind not in "iu":
            raise DataError(f"{idx_path}: tokens are stored as {self.dtype.name}, not an integer type")
        lengths = index.sequence_lengths.astype(np.int64)
        ends = np.concatenate([[0], np.cumsum(lengths)])
        self.num_tokens = int(ends[-1])
        _check_index(idx_path, lengths, ends, index.sequence_pointers, index.document_indices, self.dtype)
        expected = self.num_tokens * self.dtype.itemsize
        actual = bin_path.stat().st_size
        if actual != expected:
            raise DataError(f"{bin_path}: {actual} bytes, but {idx_path.name} indexes {self.num_tokens} "
                            f"{self.dtype.name} tokens = {expected} bytes; the dataset is incomplete or mixed up, "
                            "rebuild it")
        self.doc_offsets = ends[np.asarray(index.document_indices, dtype=np.int64)]
        self.num_documents = len(self.doc_offsets) - 1
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        sidecar = _read_sidecar(sidecar_path) if sidecar_path.is_file() else {}
        self.tokenizer_name: str | None = sidecar.get("tokenizer")
        self.vocab_size: int | None = sidecar.get("vocab_size")
        self.eos_id: int | None = sidecar.get("eos_id")

    def check_token_ids(self, vocabularies: dict[str, int]) -> None:
        """Fail with one line if a token id is negative or not below every size in ``vocabularies`` (``{"model
        'x'": 384, "tokenizer 'byte'": 259}``, named in the message): all ids of a file up to ``_CHECKED_BYTES``,
        else a deterministic sample of that many bytes."""
        limit = min(vocabularies.values())
        bin_path = dataset_files(self.prefix)[0]
        for start, stop in _sample_spans(self.num_tokens, _CHECKED_BYTES // self.dtype.itemsize):
            block = self.tokens[start:stop].astype(np.int64)
            if int(block.max()) < limit and int(block.min()) >= 0:
                continue
            offset = start + int(np.flatnonzero((block >= limit) | (block < 0))[0])
            sizes = ", ".join(f"{name}: {size} ids" for name, size in vocabularies.items())
            raise DataError(f"{bin_path}: token id {int(self.tokens[offset])} at token {offset} is outside the "
                            f"vocabulary ({sizes}); the file is damaged or was built for another tokenizer, rebuild "
                            "it with `loongforge preprocess`")

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Fail if ``tokenizer`` cannot have written these ids: another tokenizer named in our sidecar, or (for a
        dataset another tool wrote) an id past the tokenizer's vocabulary."""
        if self.tokenizer_name is None:
            self.check_token_ids({f"tokenizer '{tokenizer.name}'": tokenizer.vocab_size})
        elif tokenizer.name != self.tokenizer_name:
            raise DataError(f"{self.prefix}: built with tokenizer '{self.tokenizer_name}', but this run uses "
                            f"'{tokenizer.name}'; rebuild the dataset or change the tokenizer")

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, index: int) -> np.ndarray:
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"document {index} out of range ({self.num_documents} documents)")
        index %= self.num_documents
        return self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]]

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"MMapTokenDataset({str(self.prefix)!r}, documents={self.num_documents}, "
                f"tokens={self.num_tokens}, tokenizer={self.tokenizer_name!r})")


@dataclasses.dataclass(frozen=True)
class _Index:
    """The arrays of a megatron ``.idx`` file (read-only views of its memory map)."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequence_pointers: np.ndarray  # int64 byte offsets into the .bin
    document_indices: np.ndarray  # int64 sequence numbers where documents start, then the sequence count


def _read_index(bin_path: Path, idx_path: Path) -> _Index:
    """The index at ``idx_path`` after its header and size are checked, each failure one line naming the file.

    Read with numpy, as megatron-core's own ``_IndexReader`` reads it (header, then int32 lengths, int64 pointers,
    int64 document marks; a multimodal index's trailing int8 modes are not needed for text), rather than through
    ``megatron.core.datasets``: importing that package initialises megatron-core and torch.distributed, seconds that
    ``loongforge check`` would spend before opening a file. tests/core/test_indexed_dataset.py reads the same files
    through megatron's ``IndexedDataset`` and asserts every array equal."""
    if not bin_path.is_file() or bin_path.stat().st_size == 0:
        found = "missing" if not bin_path.is_file() else "empty"
        raise DataError(f"{bin_path}: {found}, but {idx_path.name} is there; the dataset is incomplete, rebuild it")

    def fail(what: str) -> typing.NoReturn:
        raise DataError(f"{idx_path}: not a readable Megatron-LM index: {what}")

    with open(idx_path, "rb") as f:
        head = f.read(_INDEX_SIZE.size)
    if len(head) < _INDEX_SIZE.size or not head.startswith(INDEX_MAGIC):
        fail("bad header (not a Megatron-LM .idx file)")
    version, code, sequences, documents = _INDEX_SIZE.unpack(head)[1:]
    if version != 1 or code not in DTYPE_CODES:
        fail(f"unsupported version {version} / dtype code {code}")
    body = idx_path.stat().st_size - _INDEX_SIZE.size
    if body not in (12 * sequences + 8 * documents, 13 * sequences + 8 * documents):
        fail(f"{body} bytes after the header do not hold {sequences} sequences and {documents} document marks "
             "(the file is truncated or damaged)")
    buffer = np.memmap(idx_path, dtype=np.uint8, mode="r")
    offset = _INDEX_SIZE.size
    lengths = np.frombuffer(buffer, dtype=np.int32, count=sequences, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(buffer, dtype=np.int64, count=sequences, offset=offset)
    offset += pointers.nbytes
    marks = np.frombuffer(buffer, dtype=np.int64, count=documents, offset=offset)
    return _Index(np.dtype(DTYPE_CODES[code]), lengths, pointers, marks)


def _check_index(idx_path: Path, lengths: np.ndarray, ends: np.ndarray, pointers: np.ndarray,
                 documents: np.ndarray, dtype: np.dtype) -> None:
    """The index must describe one contiguous stream (what ``IndexedDatasetBuilder`` writes) split into documents
    by a document index running from sequence 0 to the last."""
    def fail(what: str) -> None:
        raise DataError(f"{idx_path}: {what}; the index is damaged, rebuild the dataset")

    if not len(lengths) or ends[-1] < 1:
        fail("it indexes no tokens")
    if int(lengths.min()) < 0:
        fail("a sequence has a negative length")
    if not np.array_equal(np.asarray(pointers, dtype=np.int64), ends[:-1] * dtype.itemsize):
        fail("sequence offsets do not follow the sequence lengths (not one contiguous token stream)")
    if len(documents) < 2 or documents[0] != 0 or documents[-1] != len(lengths) or np.any(np.diff(documents) < 0):
        fail(f"the document index does not run in order from sequence 0 to {len(lengths)}")


def _read_sidecar(path: Path) -> dict[str, Any]:
    """Our sidecar, every key present and of its type (one line naming the file and key if not)."""
    try:
        sidecar = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise DataError(f"{path}: unreadable dataset sidecar: {type(exc).__name__}: {exc}") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} sidecar")
    if sidecar.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: unsupported version {sidecar.get('version')!r} (this LoongForge reads version "
                        f"{FORMAT_VERSION}); rebuild the dataset")
    for key, least in (("vocab_size", 1), ("eos_id", 0)):
        value = sidecar.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataError(f"{path}: '{key}' must be an integer >= {least}, got {value!r}")
    if sidecar["eos_id"] >= sidecar["vocab_size"]:
        raise DataError(f"{path}: 'eos_id' {sidecar['eos_id']} is outside the vocabulary of "
                        f"{sidecar['vocab_size']} ids")
    if not isinstance(sidecar.get("tokenizer"), str):
        raise DataError(f"{path}: 'tokenizer' must be the name of a tokenizer, got {sidecar.get('tokenizer')!r}")
    return sidecar


def _sample_spans(length: int, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` spans covering ``length`` items whole when it is at most ``budget``, else
    :data:`_SAMPLE_BLOCKS` evenly spaced blocks of ``budget`` items in total, from the first item to the last."""
    if length <= budget:
        return [(0, length)]
    block = max(1, budget // _SAMPLE_BLOCKS)
    starts = np.linspace(0, length - block, _SAMPLE_BLOCKS, dtype=np.int64)
    return [(int(start), int(start) + block) for start in starts]
