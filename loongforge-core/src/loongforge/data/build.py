"""Documents -> a token dataset on disk, with a progress display (:mod:`loongforge.progress`).

Tokenizing is the slow part of preparing data, so for text files the bar counts input bytes (known up front from
the file sizes) rather than documents (unknown until the files are read), which gives an honest ETA; streamed
columnar inputs (:mod:`loongforge.data.hf_datasets`) count rows, without a total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset, TokenDatasetWriter
from loongforge.data.sources import check_inputs, iter_documents
from loongforge.data.tokenizers import Tokenizer
from loongforge.progress import job_progress


def build_token_dataset(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    txt_split: str = "paragraph",
    progress: bool = True,
) -> MMapTokenDataset:
    """Tokenize ``.txt``/``.jsonl`` ``inputs`` (see :mod:`loongforge.data.sources`) into ``output_prefix``.

    Documents are appended in input order, each followed by ``eos``; empty documents are skipped.
    Returns the written dataset, opened and verified.
    """
    paths = check_inputs(inputs)
    documents = (doc for path in paths for doc in iter_documents(path, text_key=text_key, txt_split=txt_split))
    return write_token_dataset(documents, output_prefix, tokenizer, total=sum(p.stat().st_size for p in paths),
                               unit="bytes", progress=progress, where=", ".join(str(p) for p in paths))


def write_token_dataset(
    documents: Iterable[tuple[str, int]],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    *,
    total: int | None,
    unit: str,
    progress: bool,
    where: str,
) -> MMapTokenDataset:
    """Tokenize ``(text, progress_units)`` pairs into ``output_prefix``; ``total`` units (``bytes`` or ``rows``,
    ``None`` if unknown) drive the bar, ``where`` names the inputs when none holds text."""
    writer = TokenDatasetWriter(
        output_prefix, vocab_size=tokenizer.vocab_size, tokenizer_name=tokenizer.name, eos_id=tokenizer.eos_id
    )
    with writer, _progress(total, unit, enabled=progress, label=f"tokenizing ({tokenizer.name})") as advance:
        for text, units in documents:
            if text:
                writer.add_document(tokenizer.encode(text))
            advance(units)
        if writer.num_documents == 0:
            raise DataError(f"no text found in {where}")
    return MMapTokenDataset(output_prefix)


@contextmanager
def _progress(total: int | None, unit: str, *, enabled: bool, label: str) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(units)``: the job progress display on stderr (:mod:`loongforge.progress`: a bar on a
    terminal, a plain line every few seconds elsewhere) when enabled, else a no-op."""
    if not enabled:
        yield lambda units: None
        return
    with job_progress(label, total=total, unit=unit, stderr=True) as progress:
        yield progress.advance
