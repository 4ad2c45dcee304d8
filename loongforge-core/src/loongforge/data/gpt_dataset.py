"""Fixed-length language-modelling samples cut from a token dataset.

Sample ``i`` is the window ``stream[i*s : i*s + s + 1]`` of the concatenated token stream (``s`` =
``seq_length``): inputs are its first ``s`` tokens, labels the last ``s``. Windows ignore document
boundaries, as in GPT pre-training: the ``eos`` between documents teaches where a text ends, and no token is
wasted on padding. Consecutive windows share one token, so every token except the first is a label once.

Gathering a batch is one numpy fancy-index on the memory map, with no Python loop over tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from loongforge.data.errors import DataError
from loongforge.data.indexed import MMapTokenDataset

if TYPE_CHECKING:
    import torch


class GPTSampleDataset:
    """Windows ``first_sample .. first_sample+num_samples-1`` of ``tokens``; ``ds[i]`` is one sample dict.

    Items have the keys of a training batch without the batch dimension, so a torch ``DataLoader`` with
    the default collate produces the same batches as :meth:`batch` (a map-style dataset: ``__len__`` and
    ``__getitem__``). torch is imported when a batch is made, not with the module: ``loongforge check`` sizes the
    splits without it.
    """

    def __init__(
        self, tokens: MMapTokenDataset, seq_length: int, *, first_sample: int = 0, num_samples: int | None = None
    ) -> None:
        if seq_length < 1:
            raise DataError(f"seq_length must be >= 1, got {seq_length}")
        total = max(0, (tokens.num_tokens - 1) // seq_length)
        if num_samples is None:
            num_samples = total - first_sample
        if first_sample < 0 or num_samples < 0 or first_sample + num_samples > total:
            raise DataError(f"{tokens.prefix}: samples {first_sample}..{first_sample + num_samples - 1} out of range:"
                            f" {tokens.num_tokens} tokens hold {total} samples of seq_length {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        self.first_sample = first_sample
        self.num_samples = num_samples
        self._offsets = np.arange(seq_length + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """``int64 [len(indices), seq_length + 1]`` token windows of the given sample indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample index out of range 0..{self.num_samples - 1}")
        starts = (indices + self.first_sample) * self.seq_length
        return self.tokens.tokens[starts[:, None] + self._offsets].astype(np.int64)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """A training batch: ``tokens``, ``labels``, ``position_ids`` (int64) and ``loss_mask`` (float32)."""
        import torch

        window = torch.from_numpy(self.windows(indices))
        b, s = window.shape[0], self.seq_length
        return {
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s, dtype=torch.float32),
            "position_ids": torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous(),
        }

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.batch(np.asarray([index])).items()}


def train_valid_split(
    tokens: MMapTokenDataset, seq_length: int, valid_fraction: float
) -> tuple[GPTSampleDataset, GPTSampleDataset | None]:
    """Hold out the last ``valid_fraction`` of the samples (at least one) for validation.

    The split is by samples, i.e. a contiguous tail of the token stream, not by documents: a small corpus of
    a few long documents (like the shipped novels) still gets a small validation set, and the two sets
    never overlap (the one token at the seam is an input in one and a label in the other).
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    full = GPTSampleDataset(tokens, seq_length)
    if len(full) == 0:
        raise DataError(f"{tokens.prefix}: no training samples: {tokens.num_tokens} token(s) are too few for one "
                        f"sample of seq_length {seq_length} (it needs {seq_length + 1}); use more text or a shorter "
                        "data.seq_length")
    if valid_fraction == 0.0:
        return full, None
    num_valid = max(1, round(len(full) * valid_fraction))
    num_train = len(full) - num_valid
    if num_train < 1:
        raise DataError(f"{tokens.prefix}: {len(full)} samples of seq_length {seq_length} are too few to hold out "
                        f"{valid_fraction:.0%} for validation")
    return (
        GPTSampleDataset(tokens, seq_length, num_samples=num_train),
        GPTSampleDataset(tokens, seq_length, first_sample=num_train, num_samples=num_valid),
    )
