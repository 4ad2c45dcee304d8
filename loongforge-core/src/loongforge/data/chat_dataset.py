"""The ``sft`` and ``shipped-chat`` dataset kinds: chat ``.jsonl`` files (OpenAI ``messages`` or ShareGPT
``conversations``, see :mod:`loongforge.data.sft`), tokenized with their loss masks.

A chat dataset is not a token stream, so it does not become a :class:`~loongforge.data.gpt_dataset.GPTSampleDataset`;
instead it is a :class:`~loongforge.data.contracts.SampleDataset` (the extension point for kinds with their own
sample layout), whose :meth:`ChatDataset.split_samples` the trainer's data builder calls. Tokenizing happens on
load: chat sets are small next to pre-training corpora, and the masks depend on the template, so there is no cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loongforge.data.chat_template import chat_template_for
from loongforge.data.contracts import SampleDataset
from loongforge.data.errors import DataError
from loongforge.data.packing import ChatRowDataset
from loongforge.data.sft import ChatSample, read_conversations, tokenize_conversation
from loongforge.data.tokenizers import Tokenizer


class ChatDataset(SampleDataset):
    """Tokenized conversations of one or more chat files, in file and line order."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: Tokenizer) -> None:
        if not paths:
            raise DataError("a chat dataset needs at least one .jsonl file in data.paths")
        template = chat_template_for(tokenizer)
        self.tokenizer = tokenizer
        self.paths = [Path(p).expanduser() for p in paths]
        self.samples: list[ChatSample] = []
        for path in self.paths:
            for lineno, chat in read_conversations(path):
                self.samples.append(tokenize_conversation(chat.messages, tokenizer, template, f"{path}:{lineno}",
                                                          tools=chat.tools, unsupervised=chat.unsupervised))
        if not self.samples:
            raise DataError(f"no conversations in {', '.join(map(str, self.paths))}")

    def __len__(self) -> int:
        return len(self.samples)

    def split_samples(self, data: Any) -> tuple[ChatRowDataset, ChatRowDataset | None]:
        """Training and validation rows for a :class:`~loongforge.config.schema.DataConfig` (``seq_length``,
        ``pack``, ``valid_fraction``: the last conversations are held out, before packing)."""
        keep = [s for s in self.samples if s.supervised[1 : data.seq_length + 1].any()]
        if not keep:
            raise DataError(f"{self.paths[0]}: no conversation has a reply within the first {data.seq_length} "
                            "tokens (raise data.seq_length)")
        train_samples, valid_samples = hold_out(keep, data.valid_fraction, f"{self.paths[0]}", "conversation(s)")
        pad = self.tokenizer.pad_id
        train = ChatRowDataset(train_samples, data.seq_length, pad, pack=data.pack)
        valid = ChatRowDataset(valid_samples, data.seq_length, pad, pack=data.pack) if valid_samples else None
        return train, valid


def hold_out(items: list[Any], fraction: float, where: str, unit: str) -> tuple[list[Any], list[Any]]:
    """``items`` split into training items and the last ``fraction`` of them (at least one when ``fraction`` > 0) for
    validation; one-line errors for a fraction outside ``[0, 1)`` or too few ``unit`` to leave any for training."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"valid_fraction must be in [0, 1), got {fraction}")
    num_valid = max(1, round(len(items) * fraction)) if fraction else 0
    if num_valid >= len(items):
        raise DataError(f"{where}: {len(items)} {unit} are too few to hold out {fraction:.0%} for validation")
    return items[: len(items) - num_valid], items[len(items) - num_valid:]


def shipped_chat_path() -> Path:
    """The chat set shipped with loongforge-core (see ``sft_data/README.md``)."""
    return Path(__file__).with_name("sft_data") / "chat.jsonl"


def sft_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> ChatDataset:
    """Chat ``.jsonl`` files (OpenAI ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}`` per line) for
    supervised fine-tuning."""
    return ChatDataset(paths, tokenizer)


def shipped_chat(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> ChatDataset:
    """The small chat set shipped with loongforge-core."""
    if paths:
        raise DataError("dataset 'shipped-chat' takes no paths (use dataset 'sft' for your own files)")
    return ChatDataset([shipped_chat_path()], tokenizer)
