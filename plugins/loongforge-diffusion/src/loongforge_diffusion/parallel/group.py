"""``ContextParallel``: the process group that splits one video's token sequence, and the shape rules it imposes.

Each of the ``size`` ranks holds one contiguous shard of ``tokens / size`` tokens (Wan's attention is
bidirectional, so the causal load-balancing zig-zag of LLM context parallelism buys nothing here). Every rank
of a group sees the same batch, text context and random draws; only the tokens are divided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from loongforge.errors import ConfigError


@dataclass(frozen=True)
class ContextParallel:
    group: Any

    @classmethod
    def from_world(cls, size: int) -> ContextParallel:
        """Split the default process group into groups of ``size`` consecutive ranks and return this rank's.

        Ranks ``[k*size, (k+1)*size)`` form context-parallel group ``k``, which is also this rank's
        data-parallel index (see :meth:`data_parallel`). Every rank must call this (``new_group`` is collective).
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ConfigError(f"context parallel: cp ({size}) must divide the world size ({world})")
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        return cls(mine)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def data_parallel(self) -> tuple[int, int]:
        """``(index, count)`` of this rank's data shard for groups made by :meth:`from_world`: all ranks of a
        context-parallel group load the same samples, so data is sharded over groups, not ranks."""
        return dist.get_rank() // self.size, dist.get_world_size() // self.size

    def check(self, num_heads: int, tokens: int) -> None:
        """Ulysses trades sequence for heads, so both must divide by the group size."""
        if num_heads % self.size:
            raise ConfigError(f"context parallel: num_heads ({num_heads}) is not divisible by cp ({self.size})")
        if tokens % self.size:
            raise ConfigError(f"context parallel: {tokens} video tokens are not divisible by cp ({self.size}); "
                              "choose frames/height/width so that (T/pt)*(H/ph)*(W/pw) is a multiple of cp")

    def span(self, total: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's shard of ``total`` tokens."""
        shard = total // self.size
        return self.rank * shard, (self.rank + 1) * shard

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of ``x`` along ``dim`` (a view)."""
        start, end = self.span(x.shape[dim])
        return x.narrow(dim, start, end - start)
