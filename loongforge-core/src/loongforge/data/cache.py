"""Tokenize raw text once and reuse the result: the ``text``, ``hf-datasets`` and ``shipped-corpus`` dataset kinds.

The cache key covers everything that changes the tokens: the tokenizer's ``name`` (which pins its
vocabulary), ``text_key``, the ``.txt`` split rule, the format version, and each input's absolute path, size and
modification time (hashing contents would mean reading every byte of a large corpus on every start). A cached
dataset that fails verification is rebuilt instead of failing the run.

Concurrent builders of the same key (several ranks) are safe: each writes its own temporary files and the
renames are atomic, with identical contents. Still, a trainer should build on one rank and wait at a barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loongforge.data.build import build_token_dataset
from loongforge.data.errors import DataError
from loongforge.data.indexed import FORMAT_VERSION, MMapTokenDataset, dataset_files
from loongforge.data.sources import check_inputs
from loongforge.data.tokenizers import Tokenizer


def default_cache_dir() -> Path:
    """``$LOONGFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/loongforge``, else ``~/.cache/loongforge``."""
    if os.environ.get("LOONGFORGE_CACHE_DIR"):
        return Path(os.environ["LOONGFORGE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loongforge"


def cached_token_dataset(
    inputs: list[str | Path],
    tokenizer: Tokenizer,
    *,
    cache_dir: str | Path | None = None,
    text_key: str = "text",
    txt_split: str = "paragraph",
    progress: bool = False,
) -> MMapTokenDataset:
    """The token dataset of text ``inputs``, built under ``cache_dir/datasets`` on first use."""
    paths = check_inputs(inputs)
    return cached_build(
        paths, {"tokenizer": tokenizer.name, "text_key": text_key, "txt_split": txt_split}, cache_dir,
        lambda prefix: build_token_dataset(paths, prefix, tokenizer, text_key=text_key, txt_split=txt_split,
                                           progress=progress),
    )


def cached_build(
    files: list[Path], options: dict[str, Any], cache_dir: str | Path | None,
    build: Callable[[Path], MMapTokenDataset],
) -> MMapTokenDataset:
    """The dataset ``build(prefix)`` writes, reused while ``files`` (by path, size and mtime) and ``options``
    (whatever else changes the tokens) stay the same; named after the first file."""
    key_parts = {
        "format_version": FORMAT_VERSION,
        **options,
        "inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:16]
    prefix = Path(cache_dir or default_cache_dir()) / "datasets" / f"{files[0].stem}-{key}"
    if dataset_files(prefix)[1].is_file():
        try:
            return MMapTokenDataset(prefix)
        except DataError:
            pass  # a damaged cache entry is rebuilt below
    return build(prefix)
