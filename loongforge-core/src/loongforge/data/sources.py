"""Raw text inputs -> documents, one at a time.

Supported inputs and what a *document* is in each (a document ends with ``eos`` in the token stream):

- ``.txt``: split by the ``txt_split`` rule, one of :data:`TXT_SPLITS`:

  * ``paragraph`` (the default): documents are separated by one or more blank lines (lines holding only
    whitespace); the lines of a paragraph keep their line breaks, the blank lines between paragraphs are dropped.
    This is the common layout of text corpora (and Hugging Face ``datasets``' ``sample_by="paragraph"``).
  * ``line``: every non-blank line is a document (one-document-per-line dumps).
  * ``file``: the whole file is one document (books, which should not get an ``eos`` after every paragraph;
    the shipped corpus is read this way).

  Lines are read one at a time, so a large file never sits in memory whole.
- ``.jsonl``: one JSON object per line, the text in field ``text_key``; blank lines are skipped. A bad line
  raises :class:`DataError` naming the file and line number, because silently dropping data hides bugs.

Each document comes with the number of input bytes it consumed, so callers can show byte-accurate progress.
Columnar inputs (parquet, arrow, ``save_to_disk`` folders) are read by :mod:`loongforge.data.hf_datasets`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from loongforge.data.errors import DataError

SUPPORTED_SUFFIXES = (".txt", ".jsonl")
#: Rules for cutting a ``.txt`` file into documents (see the module docstring).
TXT_SPLITS = ("paragraph", "line", "file")


def check_inputs(inputs: list[str | Path]) -> list[Path]:
    """Resolve input paths, failing early (before any work) on a missing file or unsupported type."""
    if not inputs:
        raise DataError("no input files given")
    paths = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.is_file():
            raise DataError(f"input file not found: {path}")
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"{path}: unsupported input type '{path.suffix}' (use {' or '.join(SUPPORTED_SUFFIXES)})")
        paths.append(path)
    return paths


def iter_documents(path: Path, *, text_key: str = "text", txt_split: str = "paragraph") -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes_consumed)`` per document of one input file.

    Empty texts (blank lines, empty files) are yielded too so that progress counts their bytes; the dataset
    builder skips them.
    """
    if txt_split not in TXT_SPLITS:
        raise DataError(f"unknown txt_split {txt_split!r}: use one of {', '.join(TXT_SPLITS)}")
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path, text_key)
    elif txt_split == "file":
        raw = path.read_bytes()
        yield _decode(raw, path), len(raw)
    else:
        yield from _iter_txt(path, per_line=txt_split == "line")


def _iter_txt(path: Path, *, per_line: bool) -> Iterator[tuple[str, int]]:
    """Paragraphs (runs of non-blank lines) or single non-blank lines of a ``.txt`` file, without the final line
    break."""
    lines: list[str] = []
    consumed = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            consumed += len(raw)
            blank = not line.strip()
            if not blank:
                lines.append(line)
            if blank or per_line:
                yield "".join(lines).rstrip("\r\n"), consumed
                lines, consumed = [], 0
    yield "".join(lines).rstrip("\r\n"), consumed


def _iter_jsonl(path: Path, text_key: str) -> Iterator[tuple[str, int]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno).strip()
            if not line:
                yield "", len(raw)
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON: {exc}") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: invalid JSON: nested too deeply to read") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: no string field {text_key!r} in this JSON line")
            yield text, len(raw)


def _decode(raw: bytes, path: Path, lineno: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{path}:{lineno}" if lineno is not None else str(path)
        raise DataError(f"{where}: not valid UTF-8 (byte {exc.start})") from None
