"""FAST (Pertsch et al., 2025): a smooth action chunk is a few low-frequency cosines, so its DCT, rounded, is mostly
zeros, and byte-pair encoding turns the common runs into single tokens.

Encoding one chunk ``(H, D)``:

1. normalise each dimension (``quantiles``: q01..q99 -> [-1, 1], as Pi0-FAST; or ``min_max``) with the plugin's
   :class:`~loongforge_embodied.data.normalize.Normalizer`, and clip to ``[-clip, clip]``;
2. orthonormal DCT-II over time per dimension (``C @ x`` with the ``(H, H)`` matrix of :func:`dct_matrix`);
3. multiply by ``scale`` and round to integers;
4. flatten frequency-major (all dimensions' frequency 0, then frequency 1, ...: the low frequencies, which carry
   the chunk, come first), one character per integer;
5. BPE (Hugging Face ``tokenizers``) over those characters, trained on the fitted chunks with ``vocab_size`` ids.

Decoding runs it backwards. The round-trip bound: rounding moves each coefficient by at most ``0.5 / scale``; the
inverse DCT sums ``H`` of them with weights ``C[k, t]``, so a normalised value moves by at most
``0.5 / scale * max_t sum_k |C[k, t]|`` (at most ``sqrt(H) * 0.5 / scale``, as ``C`` is orthonormal), and a raw one
by that times its dimension's normalisation spread. That holds for every value within ``clip`` in normalised units
(``in_range``); values beyond are clipped first.

The BPE alphabet is every integer a clipped chunk can give (``|k| <= ceil(scale * clip * max_k sum_t |C[k, t]|)``),
as characters from U+10000 on (no whitespace, controls or surrogates), so any in-range chunk encodes without an
unknown token. Malformed ids decode without failing: ids outside the vocabulary are dropped, then the coefficients
are cut to ``H * D`` or padded with zeros (the missing high frequencies) before the inverse DCT.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.action_tokens.base import (
    ActionStats,
    ActionTokenizerError,
    TokenizerKind,
    check_chunk,
    fit_length,
    read_array,
    write_tokenizer_file,
)
from loongforge_embodied.data.normalize import MODES, Normalizer

#: The BPE model beside :data:`~loongforge_embodied.action_tokens.base.TOKENIZER_FILE` (``tokenizers``' JSON).
BPE_FILE = "fast_bpe.json"
#: The code point of the most negative coefficient; the alphabet runs up from it.
FIRST_CODE_POINT = 0x10000
NORMALIZATIONS = ("quantiles", "min_max")
_KEY = "action"


@dataclass(frozen=True)
class FastOptions:
    """``fast``: DCT scale, BPE vocabulary, how actions are normalised and where they clip."""

    #: Coefficients are multiplied by this and rounded: larger is finer (error ~ 1 / scale) and longer.
    scale: float = 10.0
    vocab_size: int = 1024
    normalization: str = "quantiles"
    #: Normalised values are clipped to ``[-clip, clip]`` (quantiles: 2 keeps values up to half the q01..q99 range
    #: beyond it); the error bound holds inside.
    clip: float = 2.0

    def __post_init__(self) -> None:
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ActionTokenizerError(f"fast: scale must be a positive number, got {self.scale!r}")
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise ActionTokenizerError(f"fast: clip must be a positive number, got {self.clip!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ActionTokenizerError(f"fast: vocab_size must be an integer of at least 2, got {self.vocab_size!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ActionTokenizerError(f"fast: normalization '{self.normalization}' is unknown; choose one of "
                                       f"{list(NORMALIZATIONS)}")


@functools.cache
def dct_matrix(horizon: int) -> np.ndarray:
    """The orthonormal DCT-II ``C`` ``(H, H)``: ``C[k, t] = s_k cos(pi (2t + 1) k / 2H)`` with ``s_0 = sqrt(1/H)``,
    ``s_k = sqrt(2/H)``; ``C @ x`` transforms the time axis and ``C.T`` inverts it (read-only)."""
    k, t = np.meshgrid(np.arange(horizon), np.arange(horizon), indexing="ij")
    matrix = np.sqrt(2.0 / horizon) * np.cos(np.pi * (2 * t + 1) * k / (2 * horizon))
    matrix[0] /= np.sqrt(2.0)
    matrix.setflags(write=False)
    return matrix


def coefficient_limit(horizon: int, options: FastOptions) -> int:
    """The largest ``|rounded coefficient|`` a chunk clipped to ``[-clip, clip]`` can give."""
    return math.ceil(options.scale * options.clip * np.abs(dct_matrix(horizon)).sum(axis=1).max())


class FastTokenizer:
    """A fitted FAST tokenizer for chunks of ``horizon`` actions; ``stats`` hold what ``normalization`` needs."""

    kind = "fast"

    def __init__(self, options: FastOptions, horizon: int, stats: ActionStats, bpe: Any) -> None:
        self.options, self.horizon, self.bpe = options, horizon, bpe
        self.stats = {name: np.asarray(stats[name], dtype=np.float64).reshape(-1)
                      for name in MODES[options.normalization]}
        self.normalizer = Normalizer({_KEY: self.stats}, {_KEY: options.normalization})
        self.limit = coefficient_limit(horizon, options)
        self._dims = next(iter(self.stats.values())).size

    @property
    def vocab_size(self) -> int:
        return self.bpe.get_vocab_size()

    @property
    def action_dim(self) -> int:
        return self._dims

    def coefficients(self, chunk: np.ndarray) -> np.ndarray:
        """The rounded, scaled DCT coefficients ``(H, D)`` (row ``k`` is frequency ``k``) of one raw chunk."""
        values = self._checked(chunk)
        normalised = np.clip(self.normalizer.normalize(_KEY, values), -self.options.clip, self.options.clip)
        return np.rint(dct_matrix(self.horizon) @ normalised * self.options.scale).astype(np.int64)

    def coefficient_text(self, chunk: np.ndarray) -> str:
        """The coefficients, frequency-major, one character each: what the BPE reads."""
        return "".join(map(chr, (self.coefficients(chunk).reshape(-1) + FIRST_CODE_POINT + self.limit).tolist()))

    def encode(self, chunk: np.ndarray) -> list[int]:
        return self.bpe.encode(self.coefficient_text(chunk)).ids

    def decode(self, ids: Sequence[int], horizon: int) -> np.ndarray:
        self._check_horizon(horizon)
        pieces = (self.bpe.id_to_token(int(i)) for i in ids if 0 <= int(i) < self.vocab_size)
        values = [ord(char) - FIRST_CODE_POINT - self.limit for piece in pieces if piece for char in piece]
        coefficients = fit_length(values, horizon * self.action_dim, 0).reshape(horizon, self.action_dim)
        normalised = dct_matrix(horizon).T @ (coefficients / self.options.scale)
        return self.normalizer.unnormalize(_KEY, normalised)

    def in_range(self, chunk: np.ndarray) -> np.ndarray:
        return np.abs(self.normalizer.normalize(_KEY, self._checked(chunk))) <= self.options.clip

    def error_bound(self, horizon: int) -> np.ndarray:
        self._check_horizon(horizon)
        spread = self.normalizer.unnormalize(_KEY, np.ones(self.action_dim)) - self.normalizer.unnormalize(
            _KEY, np.zeros(self.action_dim))
        return 0.5 / self.options.scale * np.abs(dct_matrix(horizon)).sum(axis=0).max() * np.abs(spread)

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        write_tokenizer_file(directory, self.kind, self.options, {"horizon": self.horizon, **self.stats})
        self.bpe.save(str(directory / BPE_FILE))

    def _checked(self, chunk: np.ndarray) -> np.ndarray:
        values = check_chunk(chunk, self.action_dim)
        self._check_horizon(len(values))
        return values

    def _check_horizon(self, horizon: int) -> None:
        if horizon != self.horizon:
            raise ActionTokenizerError(f"fast: this tokenizer was fitted on chunks of {self.horizon} actions, "
                                       f"got {horizon}")


def fit_fast(chunks: np.ndarray, stats: ActionStats, options: FastOptions) -> FastTokenizer:
    """Normalise with ``stats``, then train the BPE on the coefficient strings of every chunk."""
    from tokenizers import Tokenizer, models, trainers

    horizon = chunks.shape[1]
    limit = coefficient_limit(horizon, options)
    alphabet = [chr(FIRST_CODE_POINT + k) for k in range(2 * limit + 1)]
    if FIRST_CODE_POINT + 2 * limit > 0x10FFFF or len(alphabet) > options.vocab_size:
        raise ActionTokenizerError(
            f"fast: vocab_size {options.vocab_size} cannot hold the {len(alphabet)} coefficient values of chunks of "
            f"{horizon} (scale {options.scale}, clip {options.clip}); raise vocab_size or lower scale or clip")
    bpe = Tokenizer(models.BPE())
    unfitted = FastTokenizer(options, horizon, stats, bpe)
    trainer = trainers.BpeTrainer(vocab_size=options.vocab_size, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator((unfitted.coefficient_text(chunk) for chunk in chunks), trainer, length=len(chunks))
    return unfitted


def load_fast(saved: Mapping[str, Any], directory: Path) -> FastTokenizer:
    from tokenizers import Tokenizer

    options = FastOptions(**saved["options"])
    stats = {name: read_array(saved, name, directory) for name in MODES[options.normalization]}
    horizon = int(read_array(saved, "horizon", directory))
    bpe_file = directory / BPE_FILE
    if not bpe_file.is_file():
        raise ActionTokenizerError(f"{bpe_file}: missing (a fast tokenizer saves its BPE model there)")
    return FastTokenizer(options, horizon, stats, Tokenizer.from_file(str(bpe_file)))


FAST = TokenizerKind(FastOptions, fit_fast, load_fast)
