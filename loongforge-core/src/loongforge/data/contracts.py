"""What a dataset kind may offer beyond a stream of tokens, declared as base classes the data path checks with
``isinstance``.

Why declared: the megatron data path used to ask datasets for ``split_samples`` / ``balanced_batches`` with
``hasattr``, so a plugin's dataset that misspelt one silently fell back to the token-stream path. A dataset kind
(core's chat data, a plugin's image-text data) derives from the class of each capability it has.
Torch-free: only names and signatures live here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loongforge.config.schema import DataConfig


class SampleDataset(abc.ABC):
    """Samples of their own (conversations with loss masks, image-text pairs) instead of windows of a token stream:
    ``training.phase: sft`` data. The data path asks it for its training and validation rows."""

    @abc.abstractmethod
    def split_samples(self, data: DataConfig) -> tuple[Any, Any | None]:
        """Training rows and validation rows (``None`` without ``data.valid_fraction``) for ``data``'s
        ``seq_length``, ``pack`` and ``valid_fraction``: map-style datasets of equal-shape micro-batch rows."""


class PreferencePairs(SampleDataset):
    """Chosen/rejected response pairs (``training.phase: dpo`` data): the rows :meth:`split_samples` returns hold
    one pair each, and their ``batch(indices)`` gives ``2 x len(indices)`` sequences -- the chosen ones of those
    pairs, then the rejected ones in the same order -- so that a pair never leaves its micro-batch (nor, under
    pipeline parallelism, the last stage that scores it), plus ``pair_index`` (the pairs' row indices)."""


class PromptSet(SampleDataset):
    """Prompts with the answers a reward checks (``training.phase: grpo`` data): the rows :meth:`split_samples`
    returns hold one prompt each -- its token ids rendered with the chat template up to where the reply begins, its
    text, ``answer`` and the name of its reward -- and their ``batch(indices)`` gives ``prompt_index`` (the rows'
    indices); the step engine samples the replies."""


class BalancedRows(abc.ABC):
    """Training rows whose samples vary in compute, which can be re-placed across data-parallel ranks every step
    (``loongforge_balance_samples``); returned by a :class:`SampleDataset` whose rows support it."""

    @abc.abstractmethod
    def balanced_batches(self, balance: Callable[[list], list], *, micro_batch_size: int, num_microbatches: int,
                         seed: int, dp_rank: int, dp_size: int) -> Any:
        """The step's batch iterator: ``balance(samples)`` (the host's ``balance_samples`` over the data-parallel
        group) decides which samples this rank trains, before they are packed into its rows."""
