"""The built-in dataset kinds that ``data.dataset`` names: ``mmap``, ``text`` and ``shipped-corpus`` (and
``hf-datasets`` in :mod:`loongforge.data.hf_datasets`).

Every kind is a factory with one signature, so the trainer treats them alike and plugins can add kinds::

    factory(paths, tokenizer, *, text_key="text", cache_dir=None, progress=False) -> MMapTokenDataset

``cache_dir`` is where kinds that tokenize on the fly keep their result (the run's output directory, or the
user cache when ``None``). A kind whose samples are not windows of a token stream (chat data,
:mod:`loongforge.data.chat_dataset`) returns instead a :class:`loongforge.data.contracts.SampleDataset`, whose
``split_samples(data_config) -> (train, valid)`` gives datasets with ``len()`` and ``batch(indices)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loongforge.data.cache import cached_token_dataset
from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset
from loongforge.data.shipped import shipped_corpus_dataset
from loongforge.data.tokenizers import Tokenizer


def mmap_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> MMapTokenDataset:
    """A Megatron-LM indexed dataset at one path prefix (``PREFIX.bin`` + ``PREFIX.idx``), written by ``loongforge
    preprocess`` or by Megatron-LM's own tools; fails if its ids cannot come from ``tokenizer``."""
    if len(paths) != 1:
        raise DataError(f"dataset 'mmap' takes exactly one path prefix (PREFIX of PREFIX.bin + PREFIX.idx), got "
                        f"{len(paths)}")
    dataset = MMapTokenDataset(paths[0])
    dataset.check_tokenizer(tokenizer)
    return dataset


def text_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    txt_split: str = "paragraph",
) -> MMapTokenDataset:
    """Raw ``.txt``/``.jsonl`` files (a ``.txt`` file's documents follow ``txt_split``, ``data.txt_split``: see
    :mod:`loongforge.data.sources`), tokenized on first use and cached."""
    return cached_token_dataset(list(paths), tokenizer, cache_dir=cache_dir, text_key=text_key, txt_split=txt_split,
                                progress=progress)


def shipped_corpus(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> MMapTokenDataset:
    """The corpus shipped with loongforge-core, tokenized on first use and cached."""
    if paths:
        raise DataError("dataset 'shipped-corpus' takes no paths (use dataset 'text' for your own files)")
    return shipped_corpus_dataset(tokenizer, cache_dir=cache_dir, progress=progress)
