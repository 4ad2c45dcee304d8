"""The English corpus shipped inside loongforge-core (three Jane Austen novels, see ``corpus/SOURCE.md``).

Why ship text at all: the quickstart must train on real prose and print readable samples on a machine with
no network and no data, right after ``pip install``.
"""

from __future__ import annotations

from pathlib import Path

from loongforge.data.cache import cached_token_dataset
from loongforge.data.indexed import MMapTokenDataset
from loongforge.data.tokenizers import ByteTokenizer, Tokenizer


def shipped_corpus_path() -> Path:
    """The folder holding the corpus ``.txt`` files and ``SOURCE.md``."""
    return Path(__file__).with_name("corpus")


def shipped_corpus_files() -> list[Path]:
    """The corpus text files, one novel (= one document) each, in a fixed order."""
    return sorted(shipped_corpus_path().glob("*.txt"))


def shipped_corpus_dataset(
    tokenizer: Tokenizer | None = None, *, cache_dir: str | Path | None = None, progress: bool = False
) -> MMapTokenDataset:
    """The corpus tokenized (by default with :class:`ByteTokenizer`), cached under ``cache_dir``."""
    return cached_token_dataset(
        shipped_corpus_files(), tokenizer or ByteTokenizer(), cache_dir=cache_dir, txt_split="file", progress=progress
    )
