"""Our memory-mapped token dataset format: the token stream on disk, read without loading it.

A dataset at ``PREFIX`` is three files:

- ``PREFIX.bin``: every document's token ids, each document followed by ``eos``, as raw little-endian
  ``uint16`` (vocabulary <= 65536) or ``int32``. Halving the size for typical vocabularies halves disk and
  page-cache use, which is what bounds reading speed.
- ``PREFIX.docs.npy``: ``int64`` document boundaries, ``num_documents + 1`` entries from 0 to ``num_tokens``;
  document ``i`` is ``bin[docs[i]:docs[i+1]]``. A plain ``.npy`` so any tool can read it.
- ``PREFIX.idx.json``: the small human-readable header (format, dtype, counts, tokenizer name).

Why verify on open: a truncated copy or a ``.bin`` from another build would otherwise train on garbage
without any error. The reader checks every header key, the ``.bin`` size and the boundaries against the header
and fails with one line naming the file (and the key). Token ids are checked against a vocabulary by
:meth:`MMapTokenDataset.check_token_ids` -- all of a small file, an evenly spread sample of a large one, so that
opening stays cheap at any size. The writer streams documents to temporary files and renames them into place with
the header last, so an interrupted build never leaves a dataset that opens.
"""

from __future__ import annotations

import array
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loongforge.data.errors import DataError

FORMAT = "loongforge-tokens"
FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}
#: Header keys holding counts, with the least value each may take.
_COUNTS = {"vocab_size": 1, "num_documents": 1, "num_tokens": 1}
#: :meth:`MMapTokenDataset.check_token_ids` reads token files up to this size whole; of a larger one it reads
#: :data:`_SAMPLE_BLOCKS` evenly spaced blocks of this size in total (the first and the last block included).
_CHECKED_BYTES = 8 << 20
_SAMPLE_BLOCKS = 64


def token_dtype(vocab_size: int) -> str:
    """Name of the narrowest stored dtype that holds ids ``0 .. vocab_size-1``."""
    return "uint16" if vocab_size <= 65536 else "int32"


def dataset_files(prefix: str | Path) -> tuple[Path, Path, Path]:
    """``(bin, docs, idx)`` paths of the dataset at ``prefix``."""
    prefix = str(Path(prefix).expanduser())
    return Path(prefix + ".bin"), Path(prefix + ".docs.npy"), Path(prefix + ".idx.json")


class TokenDatasetWriter:
    """Appends documents to a new dataset; use as a context manager or call :meth:`finish`.

    Leaving the ``with`` block normally finishes the dataset; leaving it with an exception deletes the
    partial files.
    """

    def __init__(self, prefix: str | Path, *, vocab_size: int, tokenizer_name: str, eos_id: int) -> None:
        self.prefix = Path(prefix).expanduser()
        self.vocab_size = vocab_size
        self.tokenizer_name = tokenizer_name
        self.eos_id = eos_id
        self.dtype = token_dtype(vocab_size)
        self.num_tokens = 0
        self._ends = array.array("q")
        self._eos = np.asarray([eos_id], dtype=_DTYPES[self.dtype]).tobytes()
        self._final = dataset_files(self.prefix)
        self._tmp = tuple(p.with_name(f"{p.name}.tmp{os.getpid()}") for p in self._final)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp[0], "wb")

    @property
    def num_documents(self) -> int:
        return len(self._ends)

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ``eos`` is added here)."""
        arr = np.asarray(ids)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise DataError(f"{self.prefix}: token id out of range 0..{self.vocab_size - 1} in document "
                            f"{self.num_documents}")
        self._bin.write(arr.astype(_DTYPES[self.dtype], copy=False).tobytes())
        self._bin.write(self._eos)
        self.num_tokens += arr.size + 1
        self._ends.append(self.num_tokens)

    def finish(self) -> None:
        """Flush, sync and move the files into place, header last."""
        if not self._ends:
            self.abort()
            raise DataError(f"{self.prefix}: no documents were added")
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        docs = np.concatenate([[0], np.frombuffer(self._ends, dtype=np.int64)])
        with open(self._tmp[1], "wb") as f:
            np.save(f, docs)
            f.flush()
            os.fsync(f.fileno())
        header = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer_name,
            "eos_id": self.eos_id,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
        }
        with open(self._tmp[2], "w", encoding="utf-8") as f:
            json.dump(header, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for tmp, final in zip(self._tmp, self._final, strict=True):
            os.replace(tmp, final)

    def abort(self) -> None:
        """Close and delete the partial files."""
        self._bin.close()
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
    """A verified, read-only, memory-mapped token dataset; ``ds[i]`` is document ``i`` (ending with eos).

    ``tokens`` is the whole stream as a ``np.memmap``: the OS pages in only what is read, so opening a
    dataset of any size is instant. Pickling stores only the prefix (DataLoader workers reopen the files
    instead of copying the tokens).
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix).expanduser()
        bin_path, docs_path, idx_path = dataset_files(self.prefix)
        if not idx_path.is_file():
            raise DataError(f"token dataset not found: {idx_path} (build it with `loongforge preprocess`)")
        header = _read_header(idx_path)
        self.header = header
        self.num_tokens: int = header["num_tokens"]
        self.num_documents: int = header["num_documents"]
        self.vocab_size: int = header["vocab_size"]
        self.tokenizer_name: str = header["tokenizer"]
        self.eos_id: int = header["eos_id"]
        self.dtype = _DTYPES[header["dtype"]]
        expected = self.num_tokens * self.dtype.itemsize
        actual = bin_path.stat().st_size if bin_path.is_file() else None
        if actual != expected:
            found = "missing" if actual is None else f"{actual} bytes"
            raise DataError(f"{bin_path}: {found}, but {idx_path.name} says {self.num_tokens} {header['dtype']} "
                            f"tokens = {expected} bytes; the dataset is incomplete or mixed up, rebuild it")
        self.doc_offsets = self._load_offsets(docs_path)
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def _load_offsets(self, docs_path: Path) -> np.ndarray:
        try:
            docs = np.load(docs_path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"{docs_path}: unreadable document index: {exc}") from None
        if (
            docs.shape != (self.num_documents + 1,)
            or docs.dtype != np.int64
            or docs[0] != 0
            or docs[-1] != self.num_tokens
            or not np.all(np.diff(docs) > 0)
        ):
            raise DataError(f"{docs_path}: document boundaries do not match {self.num_documents} documents of "
                            f"{self.num_tokens} tokens; rebuild the dataset")
        return docs

    def check_token_ids(self, vocabularies: dict[str, int]) -> None:
        """Fail with one line if a token id is negative or not below every size in ``vocabularies`` (``{"model
        'x'": 384, "tokenizer 'byte'": 259}``, named in the message): all ids of a file up to ``_CHECKED_BYTES``,
        else a deterministic sample of that many bytes."""
        limit = min(vocabularies.values())
        bin_path = dataset_files(self.prefix)[0]
        for start, stop in _sample_spans(self.num_tokens, _CHECKED_BYTES // self.dtype.itemsize):
            block = self.tokens[start:stop]
            if int(block.max()) < limit and int(block.min()) >= 0:
                continue
            offset = start + int(np.flatnonzero((block >= limit) | (block < 0))[0])
            sizes = ", ".join(f"{name}: {size} ids" for name, size in vocabularies.items())
            raise DataError(f"{bin_path}: token id {int(self.tokens[offset])} at token {offset} is outside the "
                            f"vocabulary ({sizes}); the file is damaged or was built for another tokenizer, rebuild "
                            "it with `loongforge preprocess`")

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, index: int) -> np.ndarray:
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"document {index} out of range ({self.num_documents} documents)")
        index %= self.num_documents
        return self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]]

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Fail if ``tokenizer`` is not the one the dataset was built with (its ids would mean other text)."""
        if tokenizer.name != self.tokenizer_name:
            raise DataError(f"{self.prefix}: built with tokenizer '{self.tokenizer_name}', but this run uses "
                            f"'{tokenizer.name}'; rebuild the dataset or change the tokenizer")

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"MMapTokenDataset({str(self.prefix)!r}, documents={self.num_documents}, "
                f"tokens={self.num_tokens}, tokenizer={self.tokenizer_name!r})")


def _read_header(idx_path: Path) -> dict[str, Any]:
    """The ``.idx.json`` header, every key present and of its type (one line naming the file and key if not)."""
    try:
        header = json.loads(idx_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise DataError(f"{idx_path}: unreadable dataset header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{idx_path}: not a {FORMAT} header")
    if header.get("version") != FORMAT_VERSION or header.get("dtype") not in _DTYPES:
        raise DataError(f"{idx_path}: unsupported version {header.get('version')!r} / dtype {header.get('dtype')!r}"
                        f" (this LoongForge reads version {FORMAT_VERSION}); rebuild the dataset")
    for key, least in {**_COUNTS, "eos_id": 0}.items():
        if key not in header:
            raise DataError(f"{idx_path}: key '{key}' is missing; rebuild the dataset with `loongforge preprocess`")
        value = header[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataError(f"{idx_path}: '{key}' must be an integer >= {least}, got {value!r}")
    if header["eos_id"] >= header["vocab_size"]:
        raise DataError(f"{idx_path}: 'eos_id' {header['eos_id']} is outside the vocabulary of "
                        f"{header['vocab_size']} ids")
    if not isinstance(header.get("tokenizer"), str):
        raise DataError(f"{idx_path}: 'tokenizer' must be the name of a tokenizer, got {header.get('tokenizer')!r}")
    return header


def _sample_spans(length: int, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` spans covering ``length`` items whole when it is at most ``budget``, else
    :data:`_SAMPLE_BLOCKS` evenly spaced blocks of ``budget`` items in total, from the first item to the last."""
    if length <= budget:
        return [(0, length)]
    block = max(1, budget // _SAMPLE_BLOCKS)
    starts = np.linspace(0, length - block, _SAMPLE_BLOCKS, dtype=np.int64)
    return [(int(start), int(start) + block) for start in starts]
