"""megatron's tensor-parallel region crossings as no autograd Function at all when the group has one rank.

``ColumnParallelLinear`` passes its input through ``copy_to_tensor_model_parallel_region`` and
``RowParallelLinear`` and ``VocabParallelEmbedding`` their output through
``reduce_from_tensor_model_parallel_region``: autograd Functions whose forward and backward are identities (or an
all-reduce) -- and, on one rank, identities in both directions. Eager, each costs an autograd node for nothing.
Under ``torch.compile`` each is traced as an ``autograd_function_apply`` higher-order op, which AOTAutograd's
cache refuses ("Unsupported call_function target"), so a compiled layer is re-traced in every new process instead
of being loaded from the cache: about half of ``compile_s`` on a warm cache. On a one-rank group the crossings
below return their input (what megatron's Function returns there too); on more ranks they are megatron's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from loongforge.devices.megatron_cpu.wrapping import replace_once

#: Where megatron's parallel layers look the crossings up.
LAYERS = "megatron.core.tensor_parallel.layers"
#: The crossings replaced there (each is the identity on a one-rank group, forward and backward).
CROSSINGS = ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region")


def _one_rank(group: Any) -> bool:
    """Whether the tensor-parallel ``group`` (megatron's default group for None) has a single rank."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    group = get_tensor_model_parallel_group_if_none(group)
    return group is not None and group.size() == 1


def skip_on_one_rank(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``original(input_, group)``, or ``input_`` itself where the group has one rank."""

    @functools.wraps(original)
    def crossing(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
        return input_ if _one_rank(group) else original(input_, group=group)

    return crossing


def patch_single_rank_crossings() -> None:
    """Install :func:`skip_on_one_rank` for each of :data:`CROSSINGS` in megatron's parallel layers (once)."""
    for name in CROSSINGS:
        replace_once(LAYERS, name, skip_on_one_rank)
