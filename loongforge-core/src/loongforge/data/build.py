"""Raw text files -> a memory-mapped token dataset, with a progress bar.

Tokenizing is the slow part of preparing data, so the bar counts input bytes (known up front from the file
sizes) rather than documents (unknown until the files are read), which gives an honest ETA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset, TokenDatasetWriter
from loongforge.data.sources import check_inputs, iter_documents
from loongforge.data.tokenizers import Tokenizer


def build_token_dataset(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    progress: bool = True,
) -> MMapTokenDataset:
    """Tokenize ``.txt``/``.jsonl`` ``inputs`` (see :mod:`loongforge.data.sources`) into ``output_prefix``.

    Documents are appended in input order, each followed by ``eos``; empty documents are skipped.
    Returns the written dataset, opened and verified.
    """
    paths = check_inputs(inputs)
    total = sum(p.stat().st_size for p in paths)
    writer = TokenDatasetWriter(
        output_prefix, vocab_size=tokenizer.vocab_size, tokenizer_name=tokenizer.name, eos_id=tokenizer.eos_id
    )
    with writer, _progress(total, enabled=progress, label=f"tokenizing ({tokenizer.name})") as advance:
        for path in paths:
            for text, nbytes in iter_documents(path, text_key=text_key):
                if text:
                    writer.add_document(tokenizer.encode(text))
                advance(nbytes)
        if writer.num_documents == 0:
            raise DataError(f"no text found in {', '.join(str(p) for p in paths)}")
    return MMapTokenDataset(output_prefix)


@contextmanager
def _progress(total: int, *, enabled: bool, label: str) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``: a rich bar on stderr when enabled, else a no-op."""
    if not enabled:
        yield lambda nbytes: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)
