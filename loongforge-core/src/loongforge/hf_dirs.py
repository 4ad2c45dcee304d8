"""Hugging Face directories: what makes one a tokenizer, and Hub ids where a directory is expected.

**Hub ids** where a Hugging Face directory is expected: ``Qwen/Qwen3-0.6B`` (or ``Qwen/Qwen3-0.6B@REV``,
a branch, tag or commit) becomes the local snapshot directory ``huggingface_hub`` downloads it into.

Why ``huggingface_hub.snapshot_download`` and nothing of our own: its cache is the one transformers, datasets and
lm-eval share (``HF_HOME`` / ``HF_HUB_CACHE``), a model downloaded by any of them is found here, and it honours
``HF_HUB_OFFLINE=1`` (the cache only), tokens and mirrors (``HF_ENDPOINT``) as users configure them. Only what a
model directory needs is fetched: configs, safetensors weights and tokenizer files, never ``.bin`` pickles.

A name is a Hub id only when it is not an existing path and has the id's shape (``owner/name``, no leading ``/`` or
``.``), so ``runs/x`` that exists stays a local directory. Where a local path was meant and is missing, the error says
both: not a local directory, and not an id the cache (or the Hub) has.
"""

from __future__ import annotations

import re
from pathlib import Path

from loongforge.errors import InteropError

#: The files that make a directory a Hugging Face tokenizer: a fast tokenizer's ``tokenizer.json``, or a SentencePiece
#: model (``tokenizer.model``) that transformers converts, as ``AutoTokenizer`` does.
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model")
#: ``owner/name`` with an optional ``@revision`` (branch, tag or commit).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
#: What a model directory needs: configs, weights (safetensors only: pickles are never read), tokenizer files.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken")


def holds_hf_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a Hugging Face tokenizer (:data:`TOKENIZER_MODELS`)."""
    return any((directory / name).is_file() for name in TOKENIZER_MODELS)


def looks_like_hub_id(name: str) -> bool:
    """``name`` has a Hub id's shape and is no existing path."""
    return bool(_HUB_ID.match(name)) and not Path(name).expanduser().exists()


def resolve_hub_directory(name: str, *, what: str = "model") -> Path:
    """The local directory of ``name``: itself when it is a path (or no Hub id), else its snapshot in the Hugging
    Face cache, downloaded if needed; one line naming ``what`` asked for it when that fails."""
    match = _HUB_ID.match(name)
    if match is None or Path(name).expanduser().exists():
        return Path(name).expanduser()
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise InteropError(f"{what} '{name}' is no local directory; reading it from the Hugging Face Hub needs "
                           "huggingface_hub: pip install 'loongforge-core[hf]'") from None
    repo, revision = match["repo"], match["revision"]
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(MODEL_FILES)))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        where = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise InteropError(f"{what} '{name}' is no local directory, and as a Hugging Face Hub id it is not in the "
                           f"cache ({constants.HF_HUB_CACHE}) while {where}: download it once online "
                           f"(huggingface-cli download {repo}) or name a local directory") from None
    except RevisionNotFoundError:
        raise InteropError(f"{what} '{name}': the Hub repository {repo} has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise InteropError(f"{what} '{name}' is no local directory, and the Hugging Face Hub has no repository "
                           f"{repo} (or it is private: log in with huggingface-cli login)") from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InteropError(f"{what} '{name}': downloading from the Hugging Face Hub failed: {first}") from None
