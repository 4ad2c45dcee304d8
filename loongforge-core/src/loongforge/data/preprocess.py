"""``loongforge preprocess``: tokenize text files into a dataset ahead of training.

Worth doing ahead of time for large corpora: every run (and every rank) then just memory-maps the result.
"""

from __future__ import annotations

from pathlib import Path

from loongforge.data.build import build_token_dataset
from loongforge.data.indexed import MMapTokenDataset, dataset_files
from loongforge.data.tokenizers import load_tokenizer


def preprocess_main(
    inputs: list[str | Path], output_prefix: str | Path, tokenizer_spec: str = "byte", text_key: str = "text"
) -> MMapTokenDataset:
    """Build the dataset with a progress bar and print a one-line summary of what was written."""
    tokenizer = load_tokenizer(tokenizer_spec)
    dataset = build_token_dataset(inputs, output_prefix, tokenizer, text_key=text_key, progress=True)
    print(
        f"wrote {dataset_files(output_prefix)[0]}: {dataset.num_documents} documents, {dataset.num_tokens} tokens "
        f"({dataset.header['dtype']}), tokenizer {tokenizer.name}"
    )
    return dataset
