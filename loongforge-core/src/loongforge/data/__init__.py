"""Data: tokenizers, memory-mapped token datasets, GPT samples, resumable batch order, the shipped corpus.

Importing this package is free (no numpy, no torch): the names below are loaded from their submodules on
first use, so ``loongforge plugins`` and config checks stay instant. Modules:

- :mod:`~loongforge.data.tokenizers`: ``Tokenizer`` protocol, ``ByteTokenizer``, ``HFTokenizer``, ``load_tokenizer``
- :mod:`~loongforge.data.indexed`: the on-disk format, Megatron-LM's indexed dataset (``TokenDatasetWriter``,
  ``MMapTokenDataset``)
- :mod:`~loongforge.data.sources` / :mod:`~loongforge.data.build` / :mod:`~loongforge.data.cache`: text files ->
  documents -> dataset, once
- :mod:`~loongforge.data.hf_datasets`: local Hugging Face ``datasets`` files (parquet, arrow, jsonl) -> dataset
- :mod:`~loongforge.data.gpt_dataset` / :mod:`~loongforge.data.sampler`: samples and batch order (torch)
- :mod:`~loongforge.data.shipped`: the bundled English corpus
- :mod:`~loongforge.data.chat_template` / :mod:`~loongforge.data.sft` / :mod:`~loongforge.data.packing` /
  :mod:`~loongforge.data.chat_dataset`: chat data for SFT (templates, reply masks, packed rows, the shipped set)
"""

from __future__ import annotations

from loongforge.lazy import lazy_exports

_EXPORTS = {
    "DataError": "errors",
    "Tokenizer": "tokenizers",
    "ByteTokenizer": "tokenizers",
    "HFTokenizer": "tokenizers",
    "load_tokenizer": "tokenizers",
    "TokenDatasetWriter": "indexed",
    "MMapTokenDataset": "indexed",
    "build_token_dataset": "build",
    "cached_token_dataset": "cache",
    "GPTSampleDataset": "gpt_dataset",
    "train_valid_split": "gpt_dataset",
    "TrainBatchIterator": "sampler",
    "eval_batches": "sampler",
    "shipped_corpus_path": "shipped",
    "shipped_corpus_files": "shipped",
    "shipped_corpus_dataset": "shipped",
    "preprocess_main": "preprocess",
    "ChatDataset": "chat_dataset",
    "ChatRowDataset": "packing",
    "chat_template_for": "chat_template",
    "shipped_chat_path": "chat_dataset",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
