"""Raw text inputs -> documents, one at a time.

Supported inputs and what a *document* is in each (a document ends with ``eos`` in the token stream):

- ``.txt``: the whole file is one document. Books and articles are natural single documents, and splitting
  prose at blank lines would put an ``eos`` after every paragraph and teach a model to stop there. Put many
  small documents in a ``.jsonl`` file instead.
- ``.jsonl``: one JSON object per line, the text in field ``text_key``; blank lines are skipped. A bad line
  raises :class:`DataError` naming the file and line number, because silently dropping data hides bugs.

Each document comes with the number of input bytes it consumed, so callers can show byte-accurate progress.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from loongforge.data.errors import DataError

SUPPORTED_SUFFIXES = (".txt", ".jsonl")


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


def iter_documents(path: Path, *, text_key: str = "text") -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes_consumed)`` per document of one input file.

    Empty texts (blank ``.jsonl`` lines, empty files) are yielded too so that progress counts their bytes;
    the dataset builder skips them.
    """
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path, text_key)
    else:
        raw = path.read_bytes()
        yield _decode(raw, path), len(raw)


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
