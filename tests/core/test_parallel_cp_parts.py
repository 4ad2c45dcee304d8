"""Context parallelism, fast checks: layout validation, the per-rank sequence split, the chunk reordering.

The numerical proof (cp=2 equals one process over 10 training steps) is tests/core/test_parallel_cp.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from loongforge.config.schema import ParallelConfig, TrainingConfig
from loongforge.devices.ulysses import natural_order
from loongforge.errors import ConfigError
from loongforge.models.llama import FLAVORS
from loongforge.parallel.context import split_for_rank
from loongforge.parallel.megatron import MegatronStrategy

DEBUG = FLAVORS["llama-debug"]  # 4 heads, 2 query groups


def check(world: int, seq_length: int = 32, **parallel):
    layout = MegatronStrategy.validate(ParallelConfig(**parallel), world, "run.yaml")
    return layout, MegatronStrategy.check_model(layout, DEBUG, TrainingConfig(micro_batch_size=2), "run.yaml",
                                                seq_length=seq_length)


def test_cp_takes_ranks_from_data_parallelism():
    layout, batch_plan = check(4, cp=2)
    assert (layout.cp, layout.dp, layout.world_size) == (2, 2, 4)
    assert batch_plan.global_batch_size == 4  # micro-batch 2 x dp 2: cp ranks share samples


@pytest.mark.parametrize(
    "world,seq_length,parallel,message",
    [
        (4, 32, {"cp": 3}, "tp*pp*cp*dp must equal the 4 processes started; got tp=1, pp=1, cp=3"),
        (4, 32, {"cp": 4}, "tp*cp=1*4 must divide the model's attention heads (4) and query groups (2)"),
        (4, 32, {"tp": 2, "cp": 2}, "tp*cp=2*2 must divide the model's attention heads (4) and query groups (2)"),
        (2, 30, {"cp": 2}, "data.seq_length (30) must be a multiple of 2*cp = 4"),
        (2, 0, {"cp": 0}, "parallel.cp must be >= 1, got 0"),
    ],
)
def test_cp_layout_errors(world, seq_length, parallel, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(world, seq_length, **parallel)


def test_split_gives_each_rank_mirrored_chunks():
    """Rank i of cp keeps chunks i and 2*cp-1-i (megatron's load-balanced causal split), for every key."""
    seq = torch.arange(16).unsqueeze(0).repeat(2, 1)
    batch = {"tokens": seq, "labels": seq + 100, "loss_mask": torch.ones(2, 16), "position_ids": seq[:1]}
    parts = [split_for_rank(batch, rank, 2) for rank in range(2)]
    assert parts[0]["tokens"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1]["tokens"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert parts[1]["labels"][1].tolist() == [104, 105, 106, 107, 108, 109, 110, 111]
    assert parts[0]["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    with pytest.raises(ValueError, match="causal attention only"):
        split_for_rank({**batch, "attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool)}, 0, 2)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_natural_order_undoes_the_split(cp):
    """Concatenating every rank's chunks (rank order, as the all-to-all gathers them) and indexing with
    ``natural_order`` gives the original sequence."""
    seq = torch.arange(12 * cp).unsqueeze(0)
    batch = {"tokens": seq, "labels": seq, "loss_mask": seq, "position_ids": seq}
    gathered = torch.cat([split_for_rank(batch, rank, cp)["tokens"][0] for rank in range(cp)])
    assert gathered[natural_order(12 * cp, cp)].tolist() == seq[0].tolist()
