"""The ``hf-datasets`` kind: Hugging Face ``datasets`` data in local files, tokenized once and cached.

``data.paths`` may mix:

- ``.parquet``, ``.arrow`` and ``.jsonl`` / ``.json`` files, read with ``datasets.load_dataset`` (the
  ``parquet``, ``arrow`` and ``json`` builders) in streaming mode;
- a folder written by ``save_to_disk``: a ``Dataset`` (``state.json`` inside), or a ``DatasetDict`` whose
  ``train`` split is used;
- any other folder: every file of the types above under it, in sorted path order.

Each row is one document, its text in column ``data.text_key``; rows are numbered from 0 in each file, and a row
whose text is missing or not a string fails with one line naming the file and row (empty strings are skipped).

Why files are always streamed: ``load_dataset`` without streaming first converts every file into an Arrow copy
under the Hugging Face cache -- a second copy of a large set on disk and an extra pass over it -- only for us to
read each row once. Streaming reads the rows straight from the files in constant memory, however large the set.
The result is a token dataset cached like the ``text`` kind's (:mod:`loongforge.data.cache`), so later runs do not
read the files at all. A ``save_to_disk`` folder is already Arrow, memory-mapped rather than copied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.data.build import write_token_dataset
from loongforge.data.cache import cached_build
from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset
from loongforge.data.tokenizers import Tokenizer

#: File suffix -> the ``datasets`` builder that reads it.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class HFInput:
    """One input: a data file, or a ``save_to_disk`` folder (``saved``); ``files`` are what the cache key covers."""

    path: Path
    files: tuple[Path, ...]
    saved: bool


def resolve_inputs(paths: Sequence[str | Path]) -> list[HFInput]:
    """``data.paths`` as inputs, failing before any work on a missing path or a file of another type."""
    if not paths:
        raise DataError("dataset 'hf-datasets' needs data.paths: parquet/arrow/jsonl files or save_to_disk folders")
    inputs: list[HFInput] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            inputs.append(HFInput(path, tuple(sorted(p for p in path.rglob("*") if p.is_file())), saved=True))
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS)
            if not found:
                raise DataError(f"{path}: no {'/'.join(BUILDERS)} files in this folder")
            inputs += [HFInput(p, (p,), saved=False) for p in found]
        elif path.is_file():
            if path.suffix not in BUILDERS:
                raise DataError(f"{path}: unsupported input type '{path.suffix}' for dataset 'hf-datasets' (use "
                                f"{', '.join(BUILDERS)} files or a save_to_disk folder)")
            inputs.append(HFInput(path, (path,), saved=False))
        else:
            raise DataError(f"input not found: {path}")
    return inputs


def iter_texts(source: HFInput, text_key: str) -> Iterator[tuple[str, int]]:
    """``(text, 1)`` per row of one input (one progress unit per row)."""
    datasets = _import_datasets()
    with _quiet(datasets):
        yield from _rows(source, text_key, datasets)


def _rows(source: HFInput, text_key: str, datasets: Any) -> Iterator[tuple[str, int]]:
    import pyarrow

    where = str(source.path)
    try:
        rows = _open_saved(source.path, datasets) if source.saved else datasets.load_dataset(
            BUILDERS[source.path.suffix], data_files=str(source.path), split="train", streaming=True)
        columns = rows.column_names
        if columns is not None and text_key not in columns:
            raise DataError(f"{where}: no column {text_key!r} (columns: {', '.join(columns)}); set data.text_key")
        row = 0
        for batch in rows.select_columns([text_key]).iter(batch_size=_BATCH_ROWS):
            for text in batch[text_key]:
                if not isinstance(text, str):
                    raise DataError(f"{where}: row {row}: column {text_key!r} holds "
                                    f"{'nothing' if text is None else type(text).__name__}, not a string")
                yield text, 1
                row += 1
    except DataError:
        raise
    except (ValueError, OSError, KeyError, pyarrow.ArrowException, datasets.exceptions.DatasetGenerationError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where}: cannot read it with Hugging Face datasets: {reason}") from None


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """Silence ``datasets``' own log lines and bars while reading: a file it cannot read is reported once, as our one
    line, not also as its logged error."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars:
            datasets.utils.enable_progress_bars()


def _open_saved(path: Path, datasets: Any) -> Any:
    """The ``Dataset`` of a ``save_to_disk`` folder; a ``DatasetDict``'s ``train`` split."""
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); name "
                            "the split's folder in data.paths")
        loaded = loaded["train"]
    return loaded


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("dataset 'hf-datasets' needs the 'datasets' package: pip install "
                        "'loongforge-core[hf-data]'") from None
    return datasets


def build_hf_token_dataset(
    paths: Sequence[str | Path], output_prefix: str | Path, tokenizer: Tokenizer, *, text_key: str = "text",
    progress: bool = True,
) -> MMapTokenDataset:
    """Tokenize the rows of ``paths`` (see the module docstring) into a token dataset at ``output_prefix``."""
    inputs = resolve_inputs(paths)
    documents = (doc for source in inputs for doc in iter_texts(source, text_key))
    return write_token_dataset(documents, output_prefix, tokenizer, total=None, unit="rows", progress=progress,
                               where=", ".join(str(i.path) for i in inputs))


def hf_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> MMapTokenDataset:
    """Rows of local Hugging Face ``datasets`` files, tokenized on first use and cached."""
    inputs = resolve_inputs(paths)
    _import_datasets()
    files = [f for i in inputs for f in i.files]
    return cached_build(
        files, {"kind": "hf-datasets", "tokenizer": tokenizer.name, "text_key": text_key}, cache_dir,
        lambda prefix: build_hf_token_dataset(paths, prefix, tokenizer, text_key=text_key, progress=progress),
    )
