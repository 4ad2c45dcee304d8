"""The ``preference`` and ``shipped-preference`` dataset kinds: chosen/rejected pairs for ``training.phase: dpo``
(the line format is :mod:`loongforge.data.preference`'s).

Why pairs stay together: DPO's loss compares the two responses of one prompt, so a pair is the unit of sampling, of
the train/validation split and of a micro-batch. :class:`PairRows` is a map-style dataset of pairs whose
``batch(indices)`` holds the chosen sequences, then the rejected ones (twice ``len(indices)`` rows), each laid out as
an unpacked SFT row (:class:`~loongforge.data.packing.ChatRowDataset`): inputs, labels shifted by one, the response
mask as ``loss_mask``. Like chat data, pairs are tokenized on load (no cache: the masks depend on the template).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loongforge.data.chat_dataset import hold_out
from loongforge.data.chat_template import chat_template_for
from loongforge.data.contracts import PreferencePairs
from loongforge.data.errors import DataError
from loongforge.data.packing import ChatRowDataset
from loongforge.data.preference import PreferencePair, read_pairs, tokenize_pair
from loongforge.data.tokenizers import Tokenizer

#: The batch key holding each pair's row index (where a precomputed reference log-prob is looked up).
PAIR_INDEX = "pair_index"


class PairRows:
    """Rows of ``seq_length`` tokens, one pair each; ``batch(indices)`` is a micro-batch of ``2 x len(indices)``
    sequences (chosen first) and their ``pair_index``."""

    def __init__(self, pairs: Sequence[PreferencePair], seq_length: int, pad_id: int) -> None:
        self.chosen = ChatRowDataset([p.chosen for p in pairs], seq_length, pad_id, pack=False)
        self.rejected = ChatRowDataset([p.rejected for p in pairs], seq_length, pad_id, pack=False)

    def __len__(self) -> int:
        return len(self.chosen)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        chosen, rejected = self.chosen.batch(indices), self.rejected.batch(indices)
        rows = {key: torch.cat([chosen[key], rejected[key]]) for key in chosen}
        rows[PAIR_INDEX] = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return rows


class PreferenceDataset(PreferencePairs):
    """Tokenized pairs of one or more preference files, in file and line order."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: Tokenizer) -> None:
        if not paths:
            raise DataError("a preference dataset needs at least one .jsonl file in data.paths")
        template = chat_template_for(tokenizer)
        self.tokenizer = tokenizer
        self.paths = [Path(p).expanduser() for p in paths]
        self.pairs = [tokenize_pair(pair, tokenizer, template, f"{path}:{lineno}")
                      for path in self.paths for lineno, pair in read_pairs(path)]
        if not self.pairs:
            raise DataError(f"no preference pairs in {', '.join(map(str, self.paths))}")

    def __len__(self) -> int:
        return len(self.pairs)

    def split_samples(self, data: Any) -> tuple[PairRows, PairRows | None]:
        """Training and validation pairs for a :class:`~loongforge.config.schema.DataConfig`: pairs whose responses
        both start within ``seq_length`` tokens (longer ones are cut there, like SFT rows), the last
        ``valid_fraction`` of them held out."""
        if data.pack:
            raise DataError("data.pack does not apply to preference pairs (one response per row)")
        keep = [p for p in self.pairs if all(side.supervised[1 : data.seq_length + 1].any()
                                             for side in (p.chosen, p.rejected))]
        if not keep:
            raise DataError(f"{self.paths[0]}: no pair has both responses within the first {data.seq_length} "
                            "tokens (raise data.seq_length)")
        train, valid = hold_out(keep, data.valid_fraction, f"{self.paths[0]}", "pair(s)")
        pad = self.tokenizer.pad_id
        return PairRows(train, data.seq_length, pad), PairRows(valid, data.seq_length, pad) if valid else None


def shipped_preference_path() -> Path:
    """The preference pairs shipped with loongforge-core (see ``preference_data/README.md``)."""
    return Path(__file__).with_name("preference_data") / "pairs.jsonl"


def preference_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> PreferenceDataset:
    """Preference ``.jsonl`` files (``{"prompt", "chosen", "rejected"}`` per line) for ``training.phase: dpo``."""
    return PreferenceDataset(paths, tokenizer)


def shipped_preference(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> PreferenceDataset:
    """The small generated preference set shipped with loongforge-core."""
    if paths:
        raise DataError("dataset 'shipped-preference' takes no paths (use dataset 'preference' for your own files)")
    return PreferenceDataset([shipped_preference_path()], tokenizer)
