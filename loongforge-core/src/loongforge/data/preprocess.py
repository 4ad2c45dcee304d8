"""``loongforge preprocess``: tokenize text files into a Megatron-LM indexed dataset ahead of training.

Inputs are ``.txt`` / ``.jsonl`` files (:mod:`loongforge.data.sources`), or -- when any is a ``.parquet`` or
``.arrow`` file or a folder -- Hugging Face ``datasets`` files, all read by :mod:`loongforge.data.hf_datasets`.

Worth doing ahead of time for large corpora: every run (and every rank) then just memory-maps the result, and
Megatron-LM itself can train on it (see :mod:`loongforge.data.indexed`).
"""

from __future__ import annotations

from pathlib import Path

from loongforge.data.build import build_token_dataset
from loongforge.data.hf_datasets import build_hf_token_dataset
from loongforge.data.indexed import MMapTokenDataset, dataset_files
from loongforge.data.tokenizers import load_tokenizer


def preprocess_main(
    inputs: list[str | Path], output_prefix: str | Path, tokenizer_spec: str = "byte", text_key: str = "text",
    txt_split: str = "paragraph",
) -> MMapTokenDataset:
    """Build the dataset with a progress bar and print a one-line summary of what was written."""
    tokenizer = load_tokenizer(tokenizer_spec)
    if any(Path(p).suffix in (".parquet", ".arrow") or Path(p).expanduser().is_dir() for p in inputs):
        dataset = build_hf_token_dataset(inputs, output_prefix, tokenizer, text_key=text_key, progress=True)
    else:
        dataset = build_token_dataset(inputs, output_prefix, tokenizer, text_key=text_key, txt_split=txt_split,
                                      progress=True)
    bin_path, idx_path, _ = dataset_files(output_prefix)
    print(
        f"wrote {bin_path} and {idx_path.name}: {dataset.num_documents} documents, {dataset.num_tokens} tokens "
        f"({dataset.dtype.name}), tokenizer {tokenizer.name}"
    )
    return dataset
